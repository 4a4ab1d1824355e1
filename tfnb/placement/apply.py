"""``tfnb.place``: apply a plan (or a plain assignment) to a model on a cluster.

The plan is checked against the model's chain and the cluster's devices before any weight
moves; the placed model is registered with the cluster, so a worker restart names it among what
must be placed again.
"""
from __future__ import annotations

from tfnb.errors import PlacementError
from tfnb.names import short_device
from tfnb.placement.plan import Plan


def _assignment(model, plan, cluster) -> dict:
    """Stage -> device from a Plan, a dict, or a list of devices (even contiguous split)."""
    chain = model.chain
    if isinstance(plan, Plan):
        plan.validate(chain, cluster.devices if cluster is not None
                      else list(set(plan.assignment.values())))
        return dict(plan.assignment)
    if isinstance(plan, (list, tuple, str)):
        from tfnb.runtime.devices import even_split

        devices = [plan] if isinstance(plan, str) else list(plan)
        if not devices or len(devices) > len(chain):
            raise PlacementError(f"{len(devices)} devices for {len(chain)} stages: expected 1 to "
                                 f"{len(chain)} devices")
        return even_split(chain.names, devices)
    if isinstance(plan, dict):
        return dict(plan)
    raise PlacementError(f"plan={plan!r:.80}: expected a tfnb Plan, a dict stage -> device, or a "
                         "list of devices")


def place(model, plan=None, cluster=None, *, timeout: float | None = 60.0, previous=None,
          files=None, progress=True, activations: str | None = None, route=None):
    """Put ``model``'s stages on the devices of ``plan`` and return the placed model.

    Parameters
    ----------
    model : tfnb.models.Model
        A llama-family model (generates text) or a Keras chain of layers (``placed(x)``).
    plan : Plan, dict or list, optional
        A :class:`Plan` (from :func:`tfnb.plan` or the placement editor), a dict stage -> device,
        or a list of devices over which stages are split evenly. Default: the ``optimal`` plan for
        ``cluster``.
    cluster : Cluster, optional
        Default: the connected cluster (:func:`tfnb.cluster.current`), if any.
    timeout : float or None
        Seconds a generate call may take before a clear error (llama models).
    previous : PlacedModel, optional
        A placement of the same model to update: only the stages whose device changed move.
    files : None, False or dict
        Where the workers read a GGUF model's weights: None (default), each worker reads the
        file at the path the model was loaded from, and a worker without it is sent its
        weights from this process; a dict gives a worker its own path (``{"worker:1":
        "/data/m.gguf"}``) or None to send to it; False sends everything. A worker's file must
        be the same as this process's (size, header and tensor table), else one
        ``PlacementError`` before anything is placed. ``placed.weight_sources`` says what
        each worker did.
    progress : bool or callable
        A progress bar of the bytes sent to each worker (from 64 MB on).
    activations : {"float32", "int8"}, optional
        How packed Q4_0, Q4_1 and Q8_0 matrices multiply: ``"int8"`` computes as llama.cpp
        does (activations rounded to int8 blocks, integer dot products; faster on matrices
        larger than the cache, slower on small ones), ``"float32"`` keeps float32 activations
        (equal to the float32 path up to summation order). Default:
        ``tfnb.runtime.placed.DEFAULT_ACTIVATIONS`` (docs/kernels.md).
    route : {"auto", "kernel", "xla"} or dict, optional
        Where packed matrices multiply: ``"kernel"``, tfnb's fused ops (CPU devices of ``tfnb
        worker``); ``"xla"``, held as plain tensors in the file's bytes and multiplied in XLA
        ops, which any TF server and any device runs (a plain ``tf.distribute.Server``, a
        GPU); ``"auto"`` (default) the kernel where a CPU device has it, else XLA. A dict sets
        it per worker or device (``{"worker:1": "xla"}``). ``placed.routes`` says what each
        device got (docs/gpu.md).

    Examples
    --------
    >>> placed = tfnb.place(model, tfnb.plan(model, cluster), cluster)    # doctest: +SKIP
    >>> placed.chat("What is the capital of France?")                     # doctest: +SKIP
    'The capital of France is Paris.'
    """
    from tfnb.cluster import current

    if activations is not None:  # checked before planning, which may take a while
        from tfnb.runtime.placed import check_activations  # imports TensorFlow

        check_activations(activations)
    cluster = cluster if cluster is not None else current(required=False)
    if route is not None:
        from tfnb.runtime.weights import check_route  # imports TensorFlow

        check_route(route, cluster.devices if cluster is not None else None)
    if plan is None:
        if cluster is None:
            raise PlacementError("place() needs a plan or a connected cluster to plan for; "
                                 "run %tfcluster local 2 or pass a list of devices")
        from tfnb.placement.planners import plan as make_plan

        plan = make_plan(model, cluster, route=route)
    if files is not None and files is not False:
        from tfnb.runtime.fileload import check_files  # imports TensorFlow

        check_files(files, cluster.workers if cluster is not None else None)
    assignment = _assignment(model, plan, cluster)
    if isinstance(plan, Plan) and plan.replicas:
        return _place_replicas(model, plan, cluster, timeout, files, progress, activations,
                               route)
    if cluster is not None:
        unknown = sorted(set(assignment.values()) - set(cluster.devices))
        if unknown:
            raise PlacementError(f"device {unknown[0]!r} is not in the cluster; it has "
                                 f"{cluster.devices}")
    # the runtime imports TensorFlow: only when a model is placed
    if model.arch == "llama":
        from tfnb.runtime import place_llama

        if previous is not None and hasattr(previous, "replace") and \
                activations in (None, getattr(previous, "activations", None)) and \
                route in (None, getattr(previous, "route", None)):
            placed = previous.replace(assignment)  # a lost previous placement reuses nothing
        else:
            placed = place_llama(model, assignment, timeout=timeout, files=files,
                                 progress=progress, activations=activations, route=route)
    elif model.arch == "keras":
        from tfnb.runtime.layers import place_layers

        placed = place_layers(model, assignment)
    else:
        raise PlacementError(f"model {model.name!r} has arch {model.arch!r}: place() runs "
                             "llama-family models and Keras chains; run this one in one process "
                             "with model.hf_model")
    placed.plan = plan if isinstance(plan, Plan) else None  # a declared attribute of both
    if cluster is not None:
        n = len(set(assignment.values()))
        cluster.register(placed, f"{model.name} placed on {n} device{'s' * (n > 1)}",
                         assignment.values())
    return placed


def _place_replicas(model, plan: Plan, cluster, timeout, files, progress, activations, route):
    """One full copy per replica (on one device, or a pipeline over a group of them); each is
    registered with the cluster on its own, so a lost worker takes only its own copy."""
    if model.arch != "llama":
        raise PlacementError(f"model {model.name!r} has arch {model.arch!r}: replicated plans run "
                             "llama-family models; plan Keras chains with mode='optimal'")
    if cluster is not None:
        unknown = sorted(set(plan.devices) - set(cluster.devices))
        if unknown:
            raise PlacementError(f"replica device {unknown[0]!r} is not in the cluster; it has "
                                 f"{cluster.devices}")
    from tfnb.runtime import ReplicatedModel, place_llama  # imports TensorFlow

    replicas = []
    for assignment in plan.replica_assignments():
        replica = place_llama(model, assignment, timeout=timeout, files=files,
                              progress=progress, activations=activations, route=route)
        if cluster is not None:
            devices = list(dict.fromkeys(assignment.values()))
            cluster.register(replica, f"{model.name} replica on "
                             f"{' + '.join(short_device(d) for d in devices)}", devices)
        replicas.append(replica)
    return ReplicatedModel(replicas, plan=plan)
