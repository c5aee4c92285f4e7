"""What router and replica send each other in their world (router rank 0, replica rank 1).

Router to replica: a header, then for a request its images (model.BATCH x model.IMAGE).
Replica to router: for each header, that header back and logits (model.BATCH x model.CLASSES):
a request's answer, or for the stop an acknowledgement (its logits mean nothing). A replica
answers in the order the headers came; the header tells the router which request an answer is
for. So the router can always have the next answer's receive posted, stop included.
"""

from __future__ import annotations

import torch
from model import BATCH, CLASSES, IMAGE
from torch import Tensor

ROUTER = 0
REPLICA = 1
WORLD_SIZE = 2

REQUEST = 0
STOP = 1  # no more requests: the replica leaves the world and exits


def header(request: int, kind: int, device: torch.device) -> Tensor:
    """[request id, kind]."""
    return torch.tensor([request, kind], dtype=torch.int64, device=device)


def empty_header(device: torch.device) -> Tensor:
    return torch.empty(2, dtype=torch.int64, device=device)


def empty_images(device: torch.device) -> Tensor:
    return torch.empty((BATCH, *IMAGE), device=device)


def empty_logits(device: torch.device) -> Tensor:
    return torch.empty((BATCH, CLASSES), device=device)
