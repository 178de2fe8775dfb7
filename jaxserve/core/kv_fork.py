"""`KVForker`: forks of the KV cache manager, a child sharing its parent's pages (and taking
a copy of its state slot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.request import Request

if TYPE_CHECKING:
    from jaxserve.core.block_tables import BlockTables
    from jaxserve.core.state_slots import StateSlots


class KVForker:
    """Starts requests on another request's KV (`KVCacheManager` delegates `fork` and
    `can_fork` here).

    Args:
        tables: The manager's `BlockTables`.
        state_slots: The manager's state group, if any: a child gets a slot of its own holding a
            copy of the parent's state, which cannot be shared by reference.
    """

    def __init__(self, tables: BlockTables, state_slots: StateSlots | None = None):
        self.tables = tables
        self.state_slots = state_slots

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's pages holding the child's computed tokens, shared by
        reference count (n > 1: all of them; `Scheduler.add_request(kv_from=...)`: a
        prefix). A shared page is copied before either writes into it. With a state group
        the child also gets a slot holding a copy of the parent's state (a state plan).

        Raises:
            ValueError: Unknown or swapped parent, a child that already holds KV, a child
                whose computed tokens are not the parent's first computed ones (or none of
                a parent that has some), or a sliding group whose pages for them the parent
                gave back (`can_fork`); with a state group, a child with fewer computed
                tokens than the parent (the state holds them all) or no free state slot.
        """
        parent_state = self.tables.on_device(parent.request_id)
        if child.request_id in self.tables.requests:
            raise ValueError(f"cannot fork into {child.request_id!r}: it already holds KV")
        num_computed = child.num_computed_tokens
        # NOTE: a child behind its parent shares at least one token; one level with it (n > 1)
        # may share none yet.
        if (num_computed > parent.num_computed_tokens
                or num_computed == 0 < parent.num_computed_tokens
                or child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]):
            raise ValueError(f"child {child.request_id!r} must match parent "
                             f"{parent.request_id!r} in its computed tokens, at least one "
                             "(use Request.fork, or set them to a prefix of the parent's)")
        if not self.tables.can_share(parent_state, num_computed):
            raise ValueError(f"cannot fork {child.request_id!r} from {parent.request_id!r} "
                             f"at {num_computed} tokens: the parent gave back pages a "
                             "sliding window still reads there")
        if self.state_slots is not None:
            if num_computed != parent.num_computed_tokens:
                raise ValueError(f"cannot fork {child.request_id!r} from "
                                 f"{parent.request_id!r} at {num_computed} tokens: the "
                                 f"parent's state holds all its {parent.num_computed_tokens}")
            if not self.state_slots.num_free_slots:
                raise ValueError(f"cannot fork {child.request_id!r} from "
                                 f"{parent.request_id!r}: no free state slot")
        self.tables.share(parent_state, child.request_id,
                          None if num_computed == parent.num_computed_tokens else num_computed)
        if self.state_slots is not None:
            self.state_slots.fork(parent.request_id, child.request_id)

    def can_fork(self, parent: Request, num_tokens: int) -> bool:
        """Whether a request computed up to the parent's first `num_tokens` tokens may
        share its pages now (`fork`): the parent holds device pages and, in every sliding
        group, still the ones those tokens' window reads; with a state group, the tokens
        are all the parent's computed ones (a state cannot go back) and a slot is free."""
        state = self.tables.device_state(parent.request_id)
        slots = self.state_slots
        return (state is not None and num_tokens <= parent.num_computed_tokens
                and self.tables.can_share(state, num_tokens)
                and (slots is None or (num_tokens == parent.num_computed_tokens
                                       and slots.num_free_slots > 0)))
