"""`agent:` of the GRPO config: train any program that talks to an OpenAI-compatible API.

With `agent.command` set, the trainer serves an AgentProxy and keeps `agent.workers` copies of
the command running (arealite/agent/route.py); no trainer script is needed. The hand-over needs
no protocol code in the agent: each task is one JSON line on its stdin, the agent answers with
one JSON line on its stdout (see docs/agents.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from arealite.api.config_loader import ConfigBase, ConfigError
from arealite.api.config_loader import help_text as _help


@dataclass
class AgentConfig(ConfigBase):
    """An agent process trained through the AgentProxy (null command = no agent)."""

    command: Optional[str] = field(
        default=None,
        metadata=_help(
            "The agent program, e.g. 'python my_agent.py' (split like a shell would, run from "
            "the launch directory). Each task: one JSON line on its stdin {data, base_url, "
            'api_key, session_id}; it answers one JSON line on stdout: {"reward": r}, or {} to '
            "have `reward:` score the session's last assistant message. Logs go to stderr."
        ),
    )
    workers: int = field(
        default=8,
        metadata=_help(
            "Copies of the command kept running, one session each at a time (restarted if "
            "they exit). Enough for the groups in flight: n_samples x concurrent episodes."
        ),
    )
    session_timeout: float = field(
        default=300.0,
        metadata=_help("Seconds a session may take; then it is dropped and the worker restarted."),
    )
    turn_discount: float = field(
        default=1.0, metadata=_help("Reward discount per earlier turn (1 = no discount).")
    )
    export_style: Literal["concat", "individual"] = field(
        default="concat",
        metadata=_help("Training rows: one per conversation (concat) or per completion."),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.command is not None and not self.command.strip():
            raise ConfigError("agent.command is empty: name the program, e.g. 'python agent.py'")
        if self.workers < 1:
            raise ConfigError(f"agent.workers must be >= 1, got {self.workers}")
        if self.session_timeout <= 0:
            raise ConfigError(f"agent.session_timeout must be > 0, got {self.session_timeout}")
        if not 0 <= self.turn_discount <= 1:
            raise ConfigError(f"agent.turn_discount must be in [0, 1], got {self.turn_discount}")
