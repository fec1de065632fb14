"""Where and how a run's processes start: inference servers, the cluster, name resolve, launchers.

Part of the experiment config (`cli_args.BaseExperimentConfig.cluster` / `.launcher`,
`GRPOConfig.server`), kept apart because only the launchers read it; `cli_args` re-exports
every class here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from arealite.api.config_loader import ConfigBase, ConfigError
from arealite.api.config_loader import help_text as _help

# How a launcher tells the trainer's clients where the servers are, and (when it starts the trainer
# while they still load) how long to wait for their health: read by arealite/inference/server_pool.
SERVER_ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
SERVERS_STARTUP_ENV = "AREAL_LLM_SERVER_STARTUP_TIMEOUT"


@dataclass
class ServerConfig(ConfigBase):
    """How the launcher starts inference servers (embedded, SGLang or vLLM)."""

    model_path: str = field(default="", metadata=_help("Defaults to actor.path."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata=_help("Server weight dtype: auto = bf16 where the device computes it natively."),
    )
    host: str = field(default="127.0.0.1", metadata=_help("Bind address."))
    max_batch_size: int = field(default=64, metadata=_help("Embedded server batch cap."))
    mem_fraction_static: float = field(default=0.8, metadata=_help("SGLang KV memory fraction."))
    context_length: Optional[int] = None
    extra_args: list[str] = field(
        default_factory=list, metadata=_help("Extra command-line args for the server.")
    )
    startup_timeout: float = field(default=300.0, metadata=_help("Seconds to become healthy."))


@dataclass
class NameResolveConfig(ConfigBase):
    type: Literal["nfs", "ray"] = field(
        default="nfs", metadata=_help("nfs: a shared filesystem; ray: a detached Ray actor.")
    )
    nfs_record_root: str = field(default="", metadata=_help("Default: <fileroot>/name_resolve."))


@dataclass
class ClusterConfig(ConfigBase):
    fileroot: str = field(default="runs", metadata=_help("Root of run directories."))
    n_nodes: int = 1
    n_gpus_per_node: int = field(default=0, metadata=_help("0 = CPU only."))
    n_cpus_per_node: Optional[int] = None
    share_gpus: bool = field(
        default=False,
        metadata=_help(
            "Servers and trainer ranks use the same GPUs (a one-GPU machine: both must fit in its "
            "memory). Local launcher only; weight_update auto then picks tensor (CUDA IPC "
            "handles; distributed is refused: NCCL refuses two members of one group on one "
            "device)."
        ),
    )
    gpu_memory_gb: Optional[float] = field(
        default=None,
        metadata=_help(
            "Memory of each GPU in GiB for the preflight memory plan "
            "(arealite/launcher/memory_plan.py); null = what nvidia-smi reports."
        ),
    )
    name_resolve: NameResolveConfig = field(default_factory=NameResolveConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ConfigError(f"cluster.gpu_memory_gb must be > 0, got {self.gpu_memory_gb}")
        if self.n_nodes < 1:
            raise ConfigError(f"cluster.n_nodes must be >= 1, got {self.n_nodes}")
        if self.n_gpus_per_node < 0:
            raise ConfigError(f"cluster.n_gpus_per_node must be >= 0, got {self.n_gpus_per_node}")


@dataclass
class SlurmConfig(ConfigBase):
    partition: Optional[str] = None
    account: Optional[str] = None
    time: str = "72:00:00"
    container_image: Optional[str] = None
    extra_srun_args: list[str] = field(default_factory=list)


@dataclass
class LauncherConfig(ConfigBase):
    trainer_port: Optional[int] = field(default=None, metadata=_help("torchrun master port."))
    single_rank_agent: bool = field(
        default=False,
        metadata=_help(
            "Local launcher, one trainer rank: true = run it under torchrun's agent like "
            "multi-rank runs; false = start the script directly with the rank environment "
            "(one Python start-up with torch fewer, ~3 s on a 2-core CPU)."
        ),
    )
    env_vars: list[str] = field(
        default_factory=list, metadata=_help("KEY=VALUE for every process.")
    )
    cpu_threads: Literal["shared", "split"] = field(
        default="shared",
        metadata=_help(
            "CPU-only nodes: shared = the trainer ranks and the servers each get every core "
            "(divided among the ranks, resp. the servers) and idle thread pools sleep "
            "(OMP_WAIT_POLICY=PASSIVE), so whichever side is busy has the machine; split = "
            "cores // all processes, for runs where both sides compute all the time."
        ),
    )
    ray_address: Optional[str] = field(default=None, metadata=_help("Ray cluster; null = local."))
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
