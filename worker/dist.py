"""The tensor-parallel group a rank belongs to, and the few collectives the engine uses."""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it), for a rendezvous or a server started next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class TPGroup:
    """One rank's view of its TP group: a device group for activations, a gloo group for control."""

    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    trace: list | None = None  # tests (--debug-collective-trace): (collective, shape, dtype) of each call
    heartbeat: object | None = None  # worker/forensics.py: Heartbeat, the collective this rank is in
    recorder: object | None = None  # worker/forensics.py: FlightRecorder, this rank's last steps

    def _record(self, name: str, x: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((name, list(x.shape), str(x.dtype).removeprefix("torch.")))
        if self.heartbeat is not None:
            self.heartbeat.enter(name)

    def _left(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.leave()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self._record("all_reduce", x)
            if x.dtype == torch.bfloat16 and x.device.type == "cpu":
                # sum the ranks' partials in float32 and round once (gloo would round after every addition)
                wide = x.float()
                dist.all_reduce(wide, group=self.group)
                self._left()
                return wide.to(x.dtype)
            dist.all_reduce(x, group=self.group)
            self._left()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        self._record("all_gather", x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self._left()
        return torch.cat(parts, dim=-1)

    def broadcast_tensor(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's tensor overwrites everyone's (control group, so CPU tensors)."""
        if self.size > 1:
            self._record("broadcast", x)
            dist.broadcast(x, src=src, group=self.cpu_group)
            self._left()
        return x

    def broadcast_device(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's tensor overwrites everyone's, on the device group (NCCL/RCCL on GPUs): no host copy, so a
        captured graph can hold it."""
        if self.size > 1:
            self._record("broadcast_device", x)
            dist.broadcast(x, src=src, group=self.group)
            self._left()
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        """Pickle on rank src, one length broadcast then one payload broadcast on the control group."""
        if self.size == 1:
            return obj
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        if self.heartbeat is not None:
            self.heartbeat.enter("broadcast_object")
        dist.broadcast(length, src=src, group=self.cpu_group)
        if self.rank != src:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._record("broadcast_object", payload)
        dist.broadcast(payload, src=src, group=self.cpu_group)
        self._left()
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())

    def all_gather_int64(self, values: torch.Tensor) -> torch.Tensor:
        """Gather a small int64 vector from every rank: [size, n]. Used by the divergence guard."""
        if self.size == 1:
            return values.unsqueeze(0)
        self._record("all_gather_int64", values)
        out = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(out, values, group=self.cpu_group)
        self._left()
        return torch.stack(out)


def single_rank_group(device: torch.device) -> TPGroup:
    return TPGroup(rank=0, size=1, device=device)
