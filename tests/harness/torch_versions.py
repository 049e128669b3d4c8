"""What the supported torch releases do differently, for the tests that run on each of them (``./dev torch VERSION``).

The behaviour is torch's own, read off each release's ``torch/distributed/checkpoint/state_dict_loader.py``: when the
storage reader cannot read a checkpoint's metadata, ``dcp.load`` fails on that rank with

- torch 2.8: the reader's own exception (``FileNotFoundError``, memstore's ``NotFoundError``);
- torch 2.9: a bare ``AssertionError`` (``assert metadata is not None``), the reader's message dropped;
- torch 2.10, 2.11: ``AssertionError("metadata is None")``, the reader's message dropped;
- torch 2.12 and newer: ``AssertionError("metadata is None; global metadata read failed: <the reader's message>")``.
"""

from __future__ import annotations

import torch

TORCH_MINOR: tuple[int, int] = (int(torch.__version__.split(".")[0]), int(torch.__version__.split(".")[1]))

# dcp.load turns a reader's failure to read the metadata into an AssertionError (torch 2.9 and newer)
LOAD_WRAPS_READER_ERROR = TORCH_MINOR >= (2, 9)
# ... whose text says "metadata is None" (2.10 and newer) and carries the reader's message (2.12 and newer)
LOAD_SAYS_METADATA_IS_NONE = TORCH_MINOR >= (2, 10)
LOAD_KEEPS_READER_MESSAGE = not LOAD_WRAPS_READER_ERROR or TORCH_MINOR >= (2, 12)
