"""Prefix caching: chained page hashes and the hash -> page index of reusable full pages."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.core.kv_page import KVPage, PageHash

if TYPE_CHECKING:
    from jaxserve.request import Request

_NO_PARENT = b"\x00" * 32


def hash_page_tokens(parent_hash: PageHash | None, token_ids: Sequence[int],
                     extra_keys: tuple = ()) -> PageHash:
    """Chained hash of one full page.

    NOTE: the parent's digest goes in, so equal pages after different prefixes never
    collide, and sha256 (not Python's `hash`) keeps collisions out of reach across tenants.

    Args:
        parent_hash: Digest of the previous page; None for the first page.
        token_ids: The page's token ids (exactly one page of them).
        extra_keys: Anything else the KV depends on, e.g. `(cache_salt,)`.

    Returns:
        A 32-byte digest.
    """
    digest = hashlib.sha256(parent_hash or _NO_PARENT)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def extra_keys_for_page(request: Request, page_index: int, page_size: int = 0) -> tuple:
    """Extra hash keys of a request's page: the cache salt and the LoRA adapter's id (two
    adapters never share KV), on the first page only; and the hash of every image whose
    placeholders the page holds (the same text with another image shares no page), with
    the image's first placeholder on the page.

    NOTE: chaining carries them into every later page, as in vLLM.
    """
    keys = ()
    if page_index == 0:
        keys = () if request.cache_salt is None else ("salt", request.cache_salt)
        keys = keys + ("lora", request.lora_id) if request.lora_id else keys
    if request.mm_items and page_size:
        first, end = page_index * page_size, (page_index + 1) * page_size
        keys += tuple(("image", item.hash, max(first, item.offset) - item.offset)
                      for item in request.mm_items if item.offset < end and item.end > first)
    return keys


def update_page_hashes(request: Request, page_size: int) -> list[PageHash]:
    """Extends `request.page_hashes` to cover every full page of its tokens and returns it."""
    hashes = request.page_hashes
    token_ids = request.all_token_ids
    for index in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[-1] if hashes else None
        page_tokens = token_ids[index * page_size:(index + 1) * page_size]
        hashes.append(hash_page_tokens(parent, page_tokens,
                                       extra_keys_for_page(request, index, page_size)))
    return hashes


class PrefixCache:
    """Index of full pages by chained hash; a hit must match the hash and the tokens.

    Pages stay indexed while owned and after their last owner leaves, until the page
    pool hands them out again (eviction). One page per hash: a second page filling with
    the same content simply stays unindexed.
    """

    def __init__(self) -> None:
        self._pages: dict[PageHash, KVPage] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def lookup(self, page_hash: PageHash, token_ids: Sequence[int]) -> KVPage | None:
        """The cached page with this hash and exactly these tokens, or None."""
        page = self._pages.get(page_hash)
        if page is None or page.token_ids != tuple(token_ids):
            return None
        return page

    def insert(self, page: KVPage, page_hash: PageHash, token_ids: Sequence[int]) -> bool:
        """Indexes `page` under `page_hash`; False when the page or the hash is taken."""
        if page.page_hash is not None or page_hash in self._pages:
            return False
        page.page_hash = page_hash
        page.token_ids = tuple(token_ids)
        self._pages[page_hash] = page
        return True

    def evict(self, page: KVPage) -> bool:
        """Drops `page` from the index (its content is about to be overwritten)."""
        if page.page_hash is None:
            return False
        del self._pages[page.page_hash]
        page.page_hash = None
        page.token_ids = None
        return True
