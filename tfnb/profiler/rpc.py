"""A minimal client of TensorFlow's ProfilerService (the gRPC service every TF server runs).

TF ships no Python stub for ``tensorflow.ProfilerService``; its messages are declared here from
the field numbers in ``tsl/profiler/protobuf/profiler_service.pb.h`` of the installed wheel, on
top of the ``ProfileOptions`` and ``XSpace`` messages TF's Python package does ship.
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "/tensorflow.ProfilerService/"
_F = descriptor_pb2.FieldDescriptorProto


def _messages():
    from tensorflow.tsl.profiler.protobuf import profiler_options_pb2, xplane_pb2

    pool = descriptor_pool.Default()
    fdp = descriptor_pb2.FileDescriptorProto(
        name="tfnb/profiler_service_v2.proto", package="tfnb_profiler", syntax="proto3",
        dependency=[profiler_options_pb2.DESCRIPTOR.name, xplane_pb2.DESCRIPTOR.name])

    def msg(name, *fields):
        m = fdp.message_type.add(name=name)
        for fname, num, ftype, tname in fields:
            f = m.field.add(name=fname, number=num, type=ftype, label=_F.LABEL_OPTIONAL)
            if tname:
                f.type_name = tname

    msg("ProfileRequest", ("duration_ms", 1, _F.TYPE_UINT64, None),
        ("opts", 4, _F.TYPE_MESSAGE, ".tensorflow.ProfileOptions"),
        ("repository_root", 5, _F.TYPE_STRING, None), ("session_id", 6, _F.TYPE_STRING, None),
        ("host_name", 7, _F.TYPE_STRING, None), ("emit_xspace", 9, _F.TYPE_BOOL, None))
    # ``xspace`` is a tensorflow.profiler.XSpace; declared as bytes (the same wire format) so
    # that collecting a trace costs no parse and re-serialization (several MB per worker).
    msg("ProfileResponse", ("empty_trace", 7, _F.TYPE_BOOL, None),
        ("xspace", 8, _F.TYPE_BYTES, None))
    msg("TerminateRequest", ("session_id", 1, _F.TYPE_STRING, None))
    msg("Empty")
    try:
        fd = pool.FindFileByName(fdp.name)
    except KeyError:
        fd = pool.Add(fdp) and pool.FindFileByName(fdp.name)
    return {n: message_factory.GetMessageClass(fd.message_types_by_name[n])
            for n in fd.message_types_by_name}


_M: dict | None = None


def messages() -> dict:
    global _M
    if _M is None:
        _M = _messages()
    return _M


def options(duration_ms: int, *, host_level: int = 2, python_level: int = 0):
    """What each session traces. Most of a worker's events are XLA HLO ops and the thread
    pool's own, at any host level, and no field here filters them (the ``trace_options`` mask
    only applies to TraceMe calls that pass one); the device tracer records nothing on CPU hosts
    and the Python tracer stays off. Trace volumes: see docs/profiling.md."""
    from tensorflow.tsl.profiler.protobuf import profiler_options_pb2

    # enable_hlo_proto: the trace's "/host:metadata" plane then holds the HLO module of every
    # live XLA executable, whose ops' metadata names the TF name scope they came from: what
    # attributes compiled time to stages and op kinds (xplane.compiled_ops). It roughly
    # triples a worker's trace (docs/profiling.md); parsed modules are remembered (xplane).
    return profiler_options_pb2.ProfileOptions(version=1, host_tracer_level=host_level,
                                               device_tracer_level=1,
                                               python_tracer_level=python_level,
                                               duration_ms=duration_ms, enable_hlo_proto=True)


class ProfilerStub:
    """Calls to one server's ProfilerService: ``address`` is ``host:port``."""

    def __init__(self, address: str):
        import grpc

        m = messages()
        self.address = address
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", -1)])

        def call(name, req, resp):
            return self.channel.unary_unary(SERVICE + name,
                                            request_serializer=req.SerializeToString,
                                            response_deserializer=resp.FromString)

        self.profile = call("Profile", m["ProfileRequest"], m["ProfileResponse"])
        self.terminate = call("Terminate", m["TerminateRequest"], m["Empty"])
        self.start_continuous = call("StartContinuousProfiling", m["ProfileRequest"], m["Empty"])
        self.stop_continuous = call("StopContinuousProfiling", m["Empty"], m["Empty"])
        self.snapshot = call("GetSnapshot", m["Empty"], m["ProfileResponse"])

    def close(self) -> None:
        self.channel.close()
