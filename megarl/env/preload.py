"""What an environment worker process loads as it starts (``megarl.env.workers.CALLS``): ``env_calls``, with the
tool machinery (transformers' schema builder, seconds to import on a busy host) imported now, within the worker's
start-up time, rather than inside a call timed by ``env.timeout_s``. The trainer's process does not import it."""

from megarl.env import tools  # noqa: F401
from megarl.env.calls import env_calls  # noqa: F401
