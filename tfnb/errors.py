"""The errors tfnb raises: one line each, naming the value received and what is accepted."""


class TfnbError(Exception):
    """Base class of every error tfnb raises on purpose."""


class SpecError(TfnbError, ValueError):
    """A cluster description (address list, dict, file, TF_CONFIG) that cannot be used."""


class ClusterError(TfnbError):
    """The cluster cannot do what was asked: unreachable, not connected, a worker lost."""


class UnreachableError(ClusterError):
    """One or more workers did not answer within the timeout."""


class NotConnectedError(ClusterError):
    """An operation needs a connected cluster and there is none."""


class WorkerLostError(ClusterError):
    """A worker died or stopped answering while it held state of ours.

    ``confirmed`` is False when TensorFlow reported a lost connection but every worker the call
    used still answers (another worker of the cluster went away): that state is not lost.
    ``reached_caller`` is True when the generate call it ended had already handed some of its
    output to its caller (a chunk event), so running it again elsewhere would repeat that.
    """

    reached_caller = False

    def __init__(self, message: str, *, confirmed: bool = True):
        super().__init__(message)
        self.confirmed = confirmed


class ModelError(TfnbError, ValueError):
    """A model name, path or file that cannot be loaded."""


class PlacementError(TfnbError, ValueError):
    """A plan or assignment that does not fit the model or the cluster."""


class GenerateError(TfnbError, ValueError):
    """Bad arguments to generate (prompt, token counts, sampling settings)."""


class GenerateStalled(GenerateError):
    """A checked request that could not run: its batch made no progress, or an interrupted
    call still holds the model (a fault of the serving side, not of the request)."""


class ProfileError(TfnbError):
    """A profile cannot be captured or read: not connected, still capturing, bad arguments."""


class StatusFileError(ClusterError, ValueError):
    """A worker's status file that cannot be trusted or read: malformed, or not private."""
