"""Page allocation for the paged latent cache: the host grows each request's page-table row ahead of need.

The host never knows how many tokens a speculative step accepted (that would need a device read), so
before each step it reserves pages for an upper bound: every token the request may hold after the
steps already enqueued plus this one, plus a margin of 2 x draft_tokens. Unallocated entries point
at the harmless last page. Writes to the page table are host -> device copies, never reads.
"""

from __future__ import annotations

import torch


class PageAllocator:
    def __init__(self, page_table: torch.Tensor, num_pages: int, page_size: int):
        self.page_table, self.page_size = page_table, page_size          # [S, MP] on the device
        self.dummy = num_pages - 1
        self.free = list(range(num_pages - 1))
        self.owned: dict[int, list[int]] = {}
        page_table.fill_(self.dummy)

    @property
    def pages_per_request(self) -> int:
        return self.page_table.shape[1]

    def ensure(self, slot: int, tokens: int) -> None:
        """Make slot's pages cover positions [0, tokens)."""
        need = min(-(-tokens // self.page_size), self.pages_per_request)
        owned = self.owned.setdefault(slot, [])
        if need <= len(owned):
            return
        if need - len(owned) > len(self.free):
            raise RuntimeError(f"out of cache pages: slot {slot} needs {need - len(owned)} more, {len(self.free)} free")
        new = [self.free.pop(0) for _ in range(need - len(owned))]
        # pinned + non_blocking: a pageable copy would make the host wait for the GPU (no run-ahead)
        src = torch.tensor(new, dtype=self.page_table.dtype, pin_memory=self.page_table.is_cuda)
        self.page_table[slot, len(owned):need].copy_(src, non_blocking=True)
        owned.extend(new)

    def release(self, slot: int) -> None:
        self.free.extend(self.owned.pop(slot, []))
        self.page_table[slot].fill_(self.dummy)
