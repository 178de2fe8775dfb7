"""One device KV page (`KVPage`), the null page's id and the prefix-cache page digest type."""

from __future__ import annotations

NULL_PAGE_ID = 0

# Digest of a page's whole prefix: sha256(parent digest, token ids, extra keys).
PageHash = bytes


def group_key(page_hash: PageHash, group: int) -> PageHash:
    """The prefix-cache key of a page of KV cache group `group` holding `page_hash`'s
    tokens: each group caches its own pages (the same tokens, other layers)."""
    return page_hash if group == 0 else page_hash + group.to_bytes(2, "little")


class KVPage:
    """One device KV page: its id, reference count and prefix-cache identity."""

    __slots__ = ("page_id", "ref_cnt", "page_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, page_id: int):
        self.page_id = page_id
        self.ref_cnt = 0
        self.page_hash: PageHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        # Links of the free queue; None when the page is not in it.
        self.prev_free: KVPage | None = None
        self.next_free: KVPage | None = None

    @property
    def is_null(self) -> bool:
        """Whether this is the null page (padding target, never handed out)."""
        return self.page_id == NULL_PAGE_ID

    def __repr__(self) -> str:
        cached = self.page_hash is not None
        return f"KVPage({self.page_id}, ref_cnt={self.ref_cnt}, cached={cached})"
