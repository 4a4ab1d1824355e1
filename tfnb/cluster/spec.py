"""Cluster descriptions: every form a user may hold, parsed into one small value type.

Accepted forms (see :func:`parse_spec`):

- ``"host:port,host:port"``: the workers of job ``worker``;
- ``{"worker": ["host:port", ...], "ps": [...]}``: jobs and their task addresses
  (a job may also map task indices to addresses, as TF does: ``{"worker": {0: "h:p"}}``);
- a path to a JSON file holding such a dict, or a ``TF_CONFIG``-style dict with ``"cluster"``;
- the ``TF_CONFIG`` environment variable (``parse_spec(tf_config=True)``);
- a :class:`tfnb.LocalCluster` or a :class:`tfnb.Cluster`;
- a TensorFlow cluster resolver (Slurm, Kubernetes, TF_CONFIG, Simple), or a
  ``tf.train.ClusterSpec``.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tfnb.errors import SpecError

_HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_JOB_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_ACCEPTED = ('"host:port,host:port", a dict like {"worker": ["host:port", ...]}, a path to a '
             "JSON cluster file, TF_CONFIG, a LocalCluster, or a TF cluster resolver")


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_address(text: object) -> str:
    """Validate one ``host:port`` address and return it normalized (no spaces).

    Examples
    --------
    >>> parse_address(" 127.0.0.1:2222 ")
    '127.0.0.1:2222'
    >>> parse_address("[::1]:2222")
    '[::1]:2222'
    """
    if not isinstance(text, str):
        raise SpecError(f"address {_short(text)} is not a string; expected 'host:port'")
    addr = text.strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise SpecError(f"address {_short(text)} has no port; expected 'host:port', e.g. "
                        "'127.0.0.1:2222'")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise SpecError(f"address {_short(text)} has port {port!r}; a port is a number from 1 "
                        "to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise SpecError(f"address {_short(text)} has an invalid IPv6 host {host!r}") from None
    elif ":" in host:
        raise SpecError(f"address {_short(text)}: write an IPv6 host in brackets, e.g. "
                        "'[::1]:2222'")
    elif not _HOST_RE.match(host):
        raise SpecError(f"address {_short(text)} has an invalid host name {host!r}")
    return f"{host}:{int(port)}"


def split_address(address: str) -> tuple[str, int]:
    """``'[::1]:22'`` -> ``('::1', 22)``; ``'h:22'`` -> ``('h', 22)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ClusterSpec:
    """Jobs and the addresses of their tasks, validated; ``jobs`` maps job name -> addresses.

    Examples
    --------
    >>> spec = ClusterSpec.parse("127.0.0.1:2222,127.0.0.1:2223")
    >>> spec
    ClusterSpec(worker=['127.0.0.1:2222', '127.0.0.1:2223'])
    >>> spec.tasks()
    [('worker', 0, '127.0.0.1:2222'), ('worker', 1, '127.0.0.1:2223')]
    """

    jobs: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def parse(cls, value: object = None, *, tf_config: bool = False) -> ClusterSpec:
        return parse_spec(value, tf_config=tf_config)

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(addrs) for job, addrs in self.jobs}

    def tasks(self) -> list[tuple[str, int, str]]:
        """(job, task index, address) for every task, in order."""
        return [(job, i, a) for job, addrs in self.jobs for i, a in enumerate(addrs)]

    @property
    def addresses(self) -> list[str]:
        return [a for _, _, a in self.tasks()]

    def device_prefix(self, address: str) -> str:
        """The TF device prefix of the task at ``address``, e.g.
        ``/job:worker/replica:0/task:1``."""
        for job, i, a in self.tasks():
            if a == address:
                return f"/job:{job}/replica:0/task:{i}"
        raise SpecError(f"address {address!r} is not in this cluster; it has {self.addresses}")

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    def __repr__(self) -> str:
        inner = ", ".join(f"{job}={list(addrs)}" for job, addrs in self.jobs)
        return f"ClusterSpec({inner})"


def _from_mapping(mapping: dict, origin: str) -> ClusterSpec:
    if "cluster" in mapping and isinstance(mapping["cluster"], dict):  # a TF_CONFIG document
        mapping = mapping["cluster"]
    if not mapping:
        raise SpecError(f"{origin} names no jobs; expected e.g. {{\"worker\": [\"host:port\"]}}")
    jobs = []
    seen: dict[str, str] = {}
    for job, tasks in mapping.items():
        if not isinstance(job, str) or not _JOB_RE.match(job):
            raise SpecError(f"{origin}: job name {_short(job)} is invalid; use lower-case "
                            "letters, digits, _")
        if isinstance(tasks, dict):  # TF's sparse form {index: address}
            try:
                order = sorted((int(k), v) for k, v in tasks.items())
            except (TypeError, ValueError):
                raise SpecError(f"{origin}: job {job!r} maps {_short(tasks)}; task keys must be "
                                "integers") from None
            if [k for k, _ in order] != list(range(len(order))):
                raise SpecError(f"{origin}: job {job!r} has task indices "
                                f"{[k for k, _ in order]}; expected 0..n-1")
            tasks = [v for _, v in order]
        elif isinstance(tasks, str):
            tasks = [t for t in tasks.split(",") if t.strip()]
        if not isinstance(tasks, (list, tuple)) or not tasks:
            raise SpecError(f"{origin}: job {job!r} has tasks {_short(tasks)}; expected a "
                            "non-empty list of 'host:port'")
        addrs = tuple(parse_address(t) for t in tasks)
        for a in addrs:
            if a in seen:
                raise SpecError(f"{origin}: address {a!r} appears twice (jobs {seen[a]!r} and "
                                f"{job!r}); each task needs its own port")
            seen[a] = job
        jobs.append((job, addrs))
    return ClusterSpec(tuple(jobs))


def _from_file(path: Path) -> ClusterSpec:
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cluster file {str(path)!r} cannot be read: {e.strerror}") from None
    except ValueError:  # the OS takes no path with a NUL byte in it
        raise SpecError(f"cluster file {str(path)!r} cannot be read: a path holds no NUL "
                        "byte") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"cluster file {str(path)!r} is not valid JSON (line {e.lineno}: "
                        f"{e.msg})") from None
    if not isinstance(data, dict):
        raise SpecError(f"cluster file {str(path)!r} holds a {type(data).__name__}; expected a "
                        "JSON object of jobs")
    return _from_mapping(data, f"cluster file {str(path)!r}")


def _from_tf_config() -> ClusterSpec:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise SpecError("TF_CONFIG is not set; set it to a JSON document like "
                        '{"cluster": {"worker": ["host:port"]}}')
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SpecError(f"TF_CONFIG is not valid JSON ({e.msg}): {_short(raw)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict):
        raise SpecError(f"TF_CONFIG {_short(raw)} has no \"cluster\" object")
    return _from_mapping(data["cluster"], "TF_CONFIG")


def parse_spec(value: object = None, *, tf_config: bool = False) -> ClusterSpec:
    """Turn any accepted cluster description into a :class:`ClusterSpec`.

    Raises :class:`tfnb.errors.SpecError` naming the bad value and the accepted forms.

    Examples
    --------
    >>> parse_spec({"worker": ["127.0.0.1:2222"]}).addresses
    ['127.0.0.1:2222']
    >>> parse_spec("localhost:1,localhost:2").as_dict()
    {'worker': ['localhost:1', 'localhost:2']}
    """
    if tf_config:
        if value is not None:
            raise SpecError("give either a cluster spec or tf_config=True, not both (got "
                            f"{_short(value)})")
        return _from_tf_config()
    if isinstance(value, ClusterSpec):
        return value
    spec_attr = getattr(value, "spec", None)
    if isinstance(spec_attr, ClusterSpec):  # LocalCluster, Cluster
        return spec_attr
    if isinstance(value, Path):
        return _from_file(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise SpecError(f"cluster spec {_short(value)} looks like JSON but is not "
                                f"({e.msg})") from None
            if not isinstance(data, dict):
                raise SpecError(f"cluster spec {_short(value)} is not a JSON object")
            return _from_mapping(data, "cluster spec")
        if text.endswith(".json") or os.sep in text and not re.search(r":\d+$", text):
            return _from_file(Path(text))
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise SpecError(f"cluster spec {_short(value)} is empty; expected {_ACCEPTED}")
        return _from_mapping({"worker": parts}, "cluster spec")
    if isinstance(value, dict):
        return _from_mapping(value, "cluster spec")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return _from_mapping({"worker": list(value)}, "cluster spec")
    # TF objects last, without importing TensorFlow for the common cases above.
    to_dict = getattr(value, "as_dict", None)
    if callable(to_dict) and type(value).__name__ == "ClusterSpec":  # tf.train.ClusterSpec
        return _from_mapping(to_dict(), "tf.train.ClusterSpec")
    resolve = getattr(value, "cluster_spec", None)
    if callable(resolve):  # a tf.distribute.cluster_resolver.ClusterResolver
        try:
            tf_spec = resolve()
        except Exception as e:  # noqa: BLE001 - resolvers raise many types (Slurm env, k8s API)
            raise SpecError(f"cluster resolver {type(value).__name__} failed: {e}") from None
        return _from_mapping(tf_spec.as_dict(), type(value).__name__)
    raise SpecError(f"cluster spec {_short(value)} is not understood; expected {_ACCEPTED}")
