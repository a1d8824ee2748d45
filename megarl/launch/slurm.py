"""``megarl launch slurm``: an sbatch script (``launch/sbatch.sh.tmpl``) for N nodes with one task per node, each
running torchrun under ``python -m megarl.launch.node`` (which owns the node's processes: ``lifetime.supervise``);
printed, or written and submitted. The NCCL/InfiniBand environment comes from defaults, then a per-cluster env file
(``launch/clusters/*.env``), then flags. The preemption and requeue flow is described at the top of the template."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

import launch as templates
from megarl.config import MegarlConfig, load_config
from megarl.config.topology import LaunchError, check_nodes, positive, train_args
from megarl.config.validate import validate
from megarl.run.preflight import preflight
from megarl.run.resume import STOPPED_FILE

DEFAULT_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron overlaps TP communication with compute only in issue order
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective ends the ranks instead of hanging the job
    "NCCL_DEBUG": "WARN",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",  # the per-node logs follow the run
}
CLUSTER_KEYS = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX")
"""Cluster-specific: written as a comment when neither the env file nor a flag sets them (NCCL picks)."""
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLACEHOLDER = re.compile(r"{{(\w+)}}")


@dataclass(kw_only=True)
class NetworkEnv:
    """NCCL / InfiniBand settings given on the command line; they override the env file."""

    nccl_ib_hca: str | None = None
    """NCCL_IB_HCA: the InfiniBand adapters NCCL may use, e.g. ``mlx5`` (every mlx5 port) or ``mlx5_0:1,mlx5_1:1``."""
    nccl_socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME: the interface of NCCL's bootstrap and socket transport, e.g. ``ib0``; also exported as
    GLOO_SOCKET_IFNAME (megarl's gloo groups), unless that is set on its own."""
    nccl_ib_gid_index: int | None = None
    """NCCL_IB_GID_INDEX: the RoCE GID index (3 on most RoCE v2 fabrics)."""
    nccl_debug: str | None = None
    """NCCL_DEBUG: WARN by default; INFO shows the transports NCCL chose."""
    extra: list[str] = field(default_factory=list)
    """Any other ``KEY=VALUE`` to set on every node (``--env``, repeatable; secrets welcome): never written into the
    script, which names only the variable; ``--submit`` passes the values in the environment of ``sbatch``."""

    def as_env(self) -> dict[str, str]:
        """The NCCL flags (written into the script)."""
        named = {"NCCL_IB_HCA": self.nccl_ib_hca, "NCCL_SOCKET_IFNAME": self.nccl_socket_ifname,
                 "NCCL_IB_GID_INDEX": self.nccl_ib_gid_index, "NCCL_DEBUG": self.nccl_debug}  # fmt: skip
        return {k: str(v) for k, v in named.items() if v is not None}

    def passed_env(self) -> dict[str, str]:
        """The ``--env`` variables (kept out of the script)."""
        return dict(parse_assignment(item, "--env") for item in self.extra)


@dataclass(kw_only=True)
class SlurmOptions:
    """One sbatch job: ``nodes`` nodes, one task per node, ``gpus_per_node`` ranks per node."""

    recipe: str
    """YAML recipe every rank trains."""
    overrides: list[str] = field(default_factory=list)
    """``key.sub=value`` overrides passed to every rank (``trainer.resume=auto`` is added)."""
    nodes: int
    """Number of nodes (``#SBATCH --nodes``)."""
    gpus_per_node: int
    """Ranks per node, one per GPU (``#SBATCH --gpus-per-node``, torchrun's ``--nproc-per-node``)."""
    cpu: bool = False
    """Request no GPUs: the ``gpus_per_node`` ranks of a node run on CPU with gloo (test clusters)."""
    cpus_per_node: int | None = None
    """CPUs of the node task; None: whole nodes (``--exclusive``, all their CPUs and memory)."""
    partition: str | None = None
    """``#SBATCH --partition``; None: the cluster's default."""
    account: str | None = None
    """``#SBATCH --account``; None: the user's default."""
    time: str | None = None
    """Time limit (``#SBATCH --time``, e.g. ``04:00:00``); None: the partition's."""
    log_dir: str | None = None
    """Folder of the logs (the batch shell's and one per node) and, with ``submit``, of the script;
    None: ``<trainer.output_dir>/slurm``."""
    env_file: str | None = None
    """Per-cluster ``KEY=VALUE`` lines exported on every node (``launch/clusters/example.env``)."""
    network: NetworkEnv = field(default_factory=NetworkEnv)
    """NCCL settings from flags (override the env file)."""
    job_name: str | None = None
    """``#SBATCH --job-name``; None: ``megarl-<recipe name>``."""
    rdzv_port: int = 29500
    """TCP port of torchrun's c10d rendezvous on the first node."""
    signal_secs: int | None = None
    """SLURM sends SIGUSR1 this many seconds before the time limit: enough for an update in progress, the stop's
    grace and a save.
    None: derived from the plan (``signal_lead``)."""
    fs_gb_s: float = 2.0
    """Checkpoint filesystem write bandwidth per node in GB/s, for the derived signal lead."""
    submit: bool = False
    """Write the script to ``log_dir`` and submit it with ``sbatch`` instead of printing it."""
    strict_paths: bool = False
    """Refuse paths this host cannot see (model, data, reward file) instead of warning about them."""

    def __post_init__(self):
        positive(self.nodes, "--nodes")
        positive(self.gpus_per_node, "--gpus-per-node")
        if self.signal_secs is not None:
            positive(self.signal_secs, "--signal-secs")
        if not self.fs_gb_s > 0:
            raise LaunchError(f"--fs-gb-s must be > 0, got {self.fs_gb_s}")
        if self.cpus_per_node is not None:
            positive(self.cpus_per_node, "--cpus-per-node")
        if not 1 <= self.rdzv_port <= 65535:
            raise LaunchError(f"--rdzv-port {self.rdzv_port} is not a TCP port (1..65535)")
        if self.job_name is not None and not re.fullmatch(r"[\w.+-]+", self.job_name):
            raise LaunchError(f"--job-name {self.job_name!r}: use letters, digits and . _ + - only")
        for option, value in (("--partition", self.partition), ("--account", self.account), ("--time", self.time),
                              ("--output", self.log_dir)):  # fmt: skip
            sbatch_value(option, value)

    def name(self) -> str:
        stem = os.path.splitext(os.path.basename(self.recipe))[0]
        return self.job_name or "megarl-" + re.sub(r"[^\w.+-]", "_", stem)


def sbatch_value(option: str, value: str | None) -> None:
    """A value for an ``#SBATCH`` line (sbatch reads those lines itself, not a shell): no whitespace, nothing a
    line could be ended or continued with."""
    if value is not None and (not value or re.search(r"[\s\\'\"`$;]", value)):
        raise LaunchError(
            f"{option} {value!r}: an #SBATCH value cannot be empty or hold whitespace, quotes, '\\', '$', '`' or "
            "';'; use a plain name or path"
        )


def parse_assignment(text: str, where: str) -> tuple[str, str]:
    """``KEY=VALUE`` (``--env``): the value as given, verbatim."""
    key, sep, value = text.partition("=")
    if not sep or not _KEY.fullmatch(key):
        raise LaunchError(f"{where}: expected KEY=VALUE, got {text.strip()!r}")
    return key, value


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines read as a shell reads them (``export`` optional; quotes; ``#`` comments, also after a
    value; blank lines skipped); one assignment per line."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise LaunchError(f"--env-file {path}: {e.strerror or e}") from None
    env = {}
    for number, line in enumerate(lines, 1):
        where = f"--env-file {path}:{number}"
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:  # an unclosed quote
            raise LaunchError(f"{where}: {e}") from None
        if words[:1] == ["export"]:
            words = words[1:]
        if not words:
            continue
        if len(words) != 1:
            raise LaunchError(f"{where}: expected KEY=VALUE, got {line.strip()!r} (quote a value with spaces)")
        env.update([parse_assignment(words[0], where)])
    return env


def gloo_ifname(env: dict[str, str], passed: dict[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME from NCCL_SOCKET_IFNAME when only the latter is given: every gloo group (metrics, the
    pools' exchange) would otherwise bind to whatever interface the node's hostname resolves to. Gloo takes interface
    names only, so NCCL's ``^`` (exclude) form is refused and its ``=`` (exact match) prefix dropped."""
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl is None or "GLOO_SOCKET_IFNAME" in env or "GLOO_SOCKET_IFNAME" in passed:
        return {}
    if nccl.startswith("^"):
        raise LaunchError(
            f"NCCL_SOCKET_IFNAME={nccl} excludes interfaces, which gloo cannot do: name the interface (e.g. ib0) or "
            "set GLOO_SOCKET_IFNAME too"
        )
    return {"GLOO_SOCKET_IFNAME": nccl.removeprefix("=")}


def job_env(opts: SlurmOptions) -> dict[str, str]:
    """What the script exports: defaults < env file < NCCL flags, and GLOO_SOCKET_IFNAME from NCCL_SOCKET_IFNAME
    (``gloo_ifname``); ``--env`` variables are not written."""
    from_file = read_env_file(opts.env_file) if opts.env_file else {}
    passed = opts.network.passed_env()
    env = {**DEFAULT_ENV, **from_file, **opts.network.as_env()}
    env.update(gloo_ifname(env, passed))
    return {k: v for k, v in env.items() if k not in passed}


def env_block(env: dict[str, str], passed: list[str]) -> str:
    unset = [f"# {k}: not set (NCCL's choice; set it in the env file or with --{k.lower().replace('_', '-')})"
             for k in CLUSTER_KEYS if k not in env]  # fmt: skip
    given = [f': "${{{k}?not set: megarl launch slurm --submit --env {k}=... passes it; else export it before '
             f'sbatch}}"; export {k}' for k in passed]  # fmt: skip
    return "\n".join([*(f"export {k}={shlex.quote(v)}" for k, v in env.items()), *given, *unset])


def sbatch_resources(opts: SlurmOptions) -> str:
    lines = [f"--partition={opts.partition}" if opts.partition else None,
             f"--account={opts.account}" if opts.account else None,
             f"--time={opts.time}" if opts.time else None,
             None if opts.cpu else f"--gpus-per-node={opts.gpus_per_node}",
             f"--cpus-per-task={opts.cpus_per_node}" if opts.cpus_per_node else "--exclusive",
             None if opts.cpus_per_node else "--mem=0"]  # fmt: skip
    return "\n".join(f"#SBATCH {line}" for line in lines if line)


def check_resume(cfg: MegarlConfig) -> None:
    if cfg.trainer.resume != "auto":
        raise LaunchError(
            f"trainer.resume={cfg.trainer.resume}: a requeued job must continue its own checkpoints; launch with "
            "trainer.resume=auto (the default; an empty trainer.output_dir starts fresh)"
        )


def log_folder(opts: SlurmOptions, cfg: MegarlConfig) -> str:
    return os.path.abspath(opts.log_dir or os.path.join(cfg.trainer.output_dir, "slurm"))


def check(opts: SlurmOptions, cfg: MegarlConfig) -> None:
    """Refuse a layout the nodes cannot hold, a resume setting requeues would break, or a path sbatch cannot take."""
    check_nodes(cfg, opts.nodes, opts.gpus_per_node, "--nodes", "--gpus-per-node")
    check_resume(cfg)
    sbatch_value("--output", log_folder(opts, cfg))
    sbatch_value("--chdir (the current directory)", os.getcwd())
    if "\n" in opts.recipe:
        raise LaunchError(f"recipe {opts.recipe!r}: a path with a newline")
    job_env(opts)  # the env file's and --env's lines parse


def render(opts: SlurmOptions, cfg: MegarlConfig, python: str = sys.executable) -> str:
    """The sbatch script, after ``check``."""
    check(opts, cfg)
    folder = os.path.dirname(os.path.abspath(templates.__file__))
    values = {
        "RECIPE": shlex.quote(opts.recipe),
        "JOB_NAME": opts.name(),
        "NODES": str(opts.nodes),
        "SBATCH_RESOURCES": sbatch_resources(opts),
        "LOG_DIR": log_folder(opts, cfg),
        "LOG_DIR_QUOTED": shlex.quote(log_folder(opts, cfg)),
        "WORKDIR": os.getcwd(),
        "SIGNAL_SECS": str(opts.signal_secs if opts.signal_secs is not None else signal_lead(opts, cfg)[0]),
        "ENV": env_block(job_env(opts), sorted(opts.network.passed_env())),
        "STOPPED": shlex.quote(os.path.join(os.path.abspath(cfg.trainer.output_dir), STOPPED_FILE)),
        "RDZV_PORT": str(opts.rdzv_port),
        "CPUS_PER_TASK": str(opts.cpus_per_node) if opts.cpus_per_node else '"$SLURM_CPUS_ON_NODE"',
        "PYTHON": shlex.quote(python),
        "RANKS_PER_NODE": str(opts.gpus_per_node),
        "TRAIN_ARGS": shlex.join(train_args(opts.recipe, [*opts.overrides, "trainer.resume=auto"])),
    }
    with open(os.path.join(folder, "sbatch.sh.tmpl")) as f:
        return fill(f.read(), values)


def fill(template: str, values: dict[str, str]) -> str:
    """Replace every ``{{NAME}}``; the template and ``values`` must name the same placeholders."""
    names = set(_PLACEHOLDER.findall(template))
    if names != set(values):
        raise ValueError(f"template placeholders {sorted(names)} differ from the values {sorted(values)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def submit(script: str, path: str, passed: dict[str, str]) -> str:
    """Write ``script`` to ``path`` (owner-only) and submit it with ``passed`` in sbatch's environment (the job
    inherits it: ``--export=ALL``); the job id."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(script)
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", "--export=ALL", path], capture_output=True, text=True,
            env={**os.environ, **passed},
        )  # fmt: skip
    except FileNotFoundError:
        raise LaunchError("--submit: sbatch is not on PATH (run on a SLURM login node, or print the script)") from None
    if out.returncode:
        raise LaunchError(f"--submit: sbatch refused {path}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def signal_lead(opts: SlurmOptions, cfg: MegarlConfig) -> tuple[int, str]:
    """The SIGUSR1 lead from the plan on these nodes (``megarl.planner.step_time.signal_lead``) and how it was derived;
    the minimum when the job cannot be planned here (its model's config.json unreadable on this host)."""
    from megarl.planner import job, step_time  # here: after the recipe's checks (the planner loads torch)

    try:
        hw = job.Hardware(opts.nodes, opts.gpus_per_node, fs_gb_s=opts.fs_gb_s)
        plan = job.make_plan(cfg, validate(cfg), hw)
    except (ValueError, OSError) as e:  # PlanError among them
        least = step_time.MIN_SIGNAL_LEAD_S
        return least, f"{least} s (the minimum: the job could not be planned here: {e})"
    lead, how = step_time.signal_lead(cfg, plan.step, plan.save)
    return lead, f"{how}; save at --fs-gb-s {opts.fs_gb_s:g} GB/s per node"


def launch(opts: SlurmOptions) -> int:
    """Print the script, or submit it and print the job id."""
    cfg = load_config(opts.recipe, opts.overrides)
    check(opts, cfg)
    for warning in preflight(cfg, opts.nodes * opts.gpus_per_node, strict_paths=opts.strict_paths):
        print(f"megarl: launch slurm: warning: {warning}", file=sys.stderr)
    if opts.signal_secs is None:
        lead, how = signal_lead(opts, cfg)
        print(f"[megarl] SIGUSR1 lead (--signal-secs): {how}", file=sys.stderr)
        opts = dataclasses.replace(opts, signal_secs=lead)
    script = render(opts, cfg)
    logs = log_folder(opts, cfg)
    os.makedirs(logs, exist_ok=True)  # SLURM does not create the folder of --output
    passed = opts.network.passed_env()
    if not opts.submit:
        print(script, end="")
        if passed:
            print(f"megarl: launch slurm: note: export {' '.join(sorted(passed))} before sbatch (--env values are not "
                  "in the script)", file=sys.stderr)  # fmt: skip
        return 0
    path = os.path.join(logs, f"{opts.name()}.sbatch")
    job_id = submit(script, path, passed)
    print(f"[megarl] submitted {path}; logs: {logs}/{opts.name()}-{job_id}-node<N>.log", file=sys.stderr)
    print(job_id)
    return 0
