"""What the training client records: one `Interaction` per choice of a chat completion, with
the exact tokens the model saw and sampled, arranged in a conversation tree.

A turn whose prompt tokens extend an earlier turn's prompt + output tokens is that turn's
child. Rewards are set per interaction; `returns(discount)` propagates them back up the tree
(a node's return is its own reward plus the discounted mean of its children's returns, so a
linear conversation with only a final reward r gives r, γr, γ²r, ... from the last turn back).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tensordict import TensorDict

from arealite.utils.data import pad_sequences_to_tensors
from arealite.workflow.rlvr import trajectory

ExportStyle = Literal["individual", "concat"]


@dataclass
class Interaction:
    """One choice of one completion, as generated (never re-tokenized)."""

    completion_id: str
    choice_index: int
    messages: list[dict[str, Any]]  # the request's messages, as the chat template saw them
    tools: list[dict[str, Any]] | None
    prompt_text: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str  # the engine's: stop / length / abort
    message: dict[str, Any]  # the assistant message returned to the agent
    reward: float | None = None
    parent: Interaction | None = field(default=None, repr=False)
    children: list[Interaction] = field(default_factory=list, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return self.completion_id, self.choice_index

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def path(self) -> list[Interaction]:
        """Root ... self."""
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class InteractionTree:
    """All interactions of one agent run, in creation order."""

    def __init__(self):
        self._items: dict[tuple[str, int], Interaction] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Interaction]:
        return iter(self._items.values())

    def get(self, completion_id: str, choice_index: int = 0) -> Interaction:
        try:
            return self._items[(completion_id, choice_index)]
        except KeyError:
            known = sorted({cid for cid, _ in self._items})
            raise KeyError(
                f"no completion {completion_id!r} choice {choice_index} in this client; "
                f"known completion ids: {known[:10]}"
            ) from None

    def add(self, item: Interaction) -> None:
        """Record `item`; its parent is the interaction with the longest prompt + output that
        its prompt tokens extend."""
        best = None
        for other in self._items.values():
            n = len(other.prompt_ids) + len(other.output_ids)
            if n < len(item.prompt_ids) and item.prompt_ids[:n] == other.tokens:
                if best is None or n > len(best.tokens):
                    best = other
        item.parent = best
        if best is not None:
            best.children.append(item)
        self._items[item.key] = item

    def set_reward(self, completion_id: str, reward: float, choice_index: int = 0) -> None:
        self.get(completion_id, choice_index).reward = float(reward)

    def set_final_reward(self, reward: float) -> None:
        """The reward of the whole run, given to the last interaction created."""
        if not self._items:
            raise ValueError("set_final_reward: the agent made no chat completion")
        next(reversed(self._items.values())).reward = float(reward)

    def returns(self, discount: float = 1.0) -> dict[tuple[str, int], float]:
        """Each interaction's own reward (0 if unset) + discount * mean of its children's."""
        if not 0 <= discount <= 1:
            raise ValueError(f"turn discount must be in [0, 1], got {discount}")
        out: dict[tuple[str, int], float] = {}
        for item in reversed(self._items.values()):  # children are created after parents
            own = item.reward or 0.0
            kids = [out[c.key] for c in item.children]
            out[item.key] = own + (discount * sum(kids) / len(kids) if kids else 0.0)
        return out

    def path_return(self, leaf: Interaction, discount: float) -> float:
        """The discounted reward along root -> leaf only (the reward of a concat sample)."""
        return sum((n.reward or 0.0) * discount**d for d, n in enumerate(leaf.path()))

    def export(self, style: ExportStyle = "individual", discount: float = 1.0) -> TensorDict:
        """Training rows like RLVRWorkflow's (input_ids, attention_mask, loss_mask, logprobs,
        versions, rewards, seq_no_eos_mask): one per interaction ('individual', reward = its
        return) or one per leaf of the tree ('concat': the whole conversation, loss mask on
        every model token along the path, reward = the path's discounted reward)."""
        if style == "individual":
            values = self.returns(discount)
            rows = [self._row([it], values[it.key]) for it in self]
        elif style == "concat":
            rows = [
                self._row(it.path(), self.path_return(it, discount))
                for it in self
                if not it.children
            ]
        else:
            raise ValueError(f"export style must be 'individual' or 'concat', got {style!r}")
        return pad_sequences_to_tensors(rows)

    @staticmethod
    def _row(path: list[Interaction], reward: float) -> dict:
        leaf = path[-1]
        ids = leaf.tokens
        loss_mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        for node in path:
            start = len(node.prompt_ids)
            for j in range(len(node.output_ids)):
                loss_mask[start + j] = 1
                logprobs[start + j] = node.output_logprobs[j]
                versions[start + j] = node.output_versions[j]
        return trajectory(ids, loss_mask, logprobs, versions, reward, leaf.stop_reason == "length")
