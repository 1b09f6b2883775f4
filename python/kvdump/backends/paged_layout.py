"""Which pool slots each query row of a step reads (docs/kvdump-v1.md "Semantics"), in numpy.

With P = page_size, after the step's writes request b holds
    kv_len(b) = (kv_indptr[b+1] - kv_indptr[b] - 1) * P + kv_last_page_len[b]   (0 without pages)
tokens; token position p lives in slot kv_indices[kv_indptr[b] + p // P] * P + p % P. Its
n_q(b) = qo_indptr[b+1] - qo_indptr[b] rows are its last n_q(b) tokens: row j sits at position
kv_len(b) - n_q(b) + j and sees positions 0 .. that position (a decode row sees all kv_len(b)).

FlashInfer's plan() takes the same arrays plus kv_len_arr = kv_len(b); `active` drops the
requests without rows (they attend to nothing) so that a kernel is never planned for them.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestRows:
    """One request with rows: its rows [row_start, row_start + num_rows) and its tokens' slots."""

    request: int
    row_start: int
    num_rows: int
    slots: np.ndarray  # int64 [kv_len], slot of each token position

    @property
    def kv_len(self):
        return int(self.slots.size)

    def visible(self):
        """bool [num_rows, kv_len]: row j sees positions 0 .. kv_len - num_rows + j."""
        first = self.kv_len - self.num_rows
        rows = np.arange(self.num_rows)[:, None]
        return np.arange(self.kv_len)[None, :] <= first + rows


def kv_lengths(kv_indptr, kv_last_page_len, page_size):
    """kv_len(b) for every request, int32 [B]."""
    pages = np.diff(kv_indptr.astype(np.int64))
    last = kv_last_page_len.astype(np.int64)
    return np.where(pages > 0, (pages - 1) * page_size + last, 0).astype(np.int32)


def token_slots(kv_indptr, kv_indices, kv_len, page_size, request):
    """int64 [kv_len(b)]: the slot of each token position of request b."""
    positions = np.arange(int(kv_len[request]), dtype=np.int64)
    pages = kv_indices[int(kv_indptr[request]) + positions // page_size].astype(np.int64)
    return pages * page_size + positions % page_size


def requests_with_rows(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size):
    """RequestRows of every request that has rows in the step, in request order."""
    kv_len = kv_lengths(kv_indptr, kv_last_page_len, page_size)
    result = []
    for b in range(kv_len.size):
        start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if stop > start:
            slots = token_slots(kv_indptr, kv_indices, kv_len, page_size, b)
            result.append(RequestRows(b, start, stop - start, slots))
    return result


@dataclass(frozen=True)
class ActiveBatch:
    """The step's index arrays without the requests that have no rows (FlashInfer's plan)."""

    qo_indptr: np.ndarray  # int32 [B'+1]
    kv_indptr: np.ndarray  # int32 [B'+1]
    kv_indices: np.ndarray  # int32 [nnz']
    kv_len: np.ndarray  # int32 [B']


def active(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size):
    """The requests with rows, renumbered; rows keep their order (they are contiguous by
    request, so removing requests without rows leaves every row where it was)."""
    rows = np.diff(qo_indptr.astype(np.int64))
    keep = np.flatnonzero(rows > 0)
    kv_len = kv_lengths(kv_indptr, kv_last_page_len, page_size)[keep]
    pages = [kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])] for b in keep]
    page_counts = np.array([p.size for p in pages], dtype=np.int64)
    return ActiveBatch(
        qo_indptr=np.concatenate([[0], np.cumsum(rows[keep])]).astype(np.int32),
        kv_indptr=np.concatenate([[0], np.cumsum(page_counts)]).astype(np.int32),
        kv_indices=(np.concatenate(pages) if pages else np.zeros(0)).astype(np.int32),
        kv_len=kv_len.astype(np.int32))
