"""Where a server's model actors run: one verifier rank per GPU, speculators spread over the
GPUs, each actor owning its device. :func:`place_devices` is the decision (pure, for tests);
:func:`count_gpus` is the one look at the host."""

from __future__ import annotations

from dataclasses import dataclass


class DeviceUnavailableError(ValueError):
    """The server asks for more GPUs than this host has (or for CUDA where torch sees none)."""


@dataclass(frozen=True)
class DevicePlacement:
    """``verifier_devices[r]`` is tensor-parallel rank ``r``'s device, ``speculator_devices[i]``
    speculator actor ``i``'s, as ``cpu`` or ``cuda:N``."""

    verifier_devices: tuple[str, ...]
    speculator_devices: tuple[str, ...]


def place_devices(device: str, tp: int, num_speculator_actors: int, num_gpus: int) -> DevicePlacement:
    """The devices for a server on ``device`` (``cpu``, ``cuda`` or ``cuda:N``) on a host with
    ``num_gpus`` GPUs.

    On CUDA, rank ``r`` owns GPU ``N + r`` (``cuda`` is ``cuda:0``), so ``tp`` ranks need ``tp``
    GPUs from ``N`` on, else :class:`DeviceUnavailableError` says how many there are. Speculator
    actors take the GPUs no rank holds first, then share the ranks' (one GPU: the verifier's).
    On the CPU everything is ``cpu``.
    """
    if device == "cpu":
        return DevicePlacement(("cpu",) * tp, ("cpu",) * num_speculator_actors)
    first = int(device.partition(":")[2] or 0)
    if num_gpus == 0:
        raise DeviceUnavailableError(f"device {device!r}: torch sees no CUDA device on this host (a CPU-only "
                                     "torch build, or no GPU): serve with --device cpu")
    if first + tp > num_gpus:
        have = max(0, num_gpus - first)
        raise DeviceUnavailableError(
            f"--tp {tp} on {device!r} needs GPUs {first}..{first + tp - 1}, one per tensor-parallel rank, but this "
            f"host has {num_gpus} GPU(s){f': use --tp {have} or less' if have else ''}")
    ranks = tuple(range(first, first + tp))
    order = [gpu for gpu in range(num_gpus) if gpu not in ranks] + list(ranks)
    return DevicePlacement(tuple(f"cuda:{gpu}" for gpu in ranks),
                           tuple(f"cuda:{order[i % len(order)]}" for i in range(num_speculator_actors)))


def count_gpus() -> int:
    """The CUDA devices torch sees here (0 without CUDA); does not initialise CUDA."""
    import torch

    return int(torch.cuda.device_count())


__all__ = ["DevicePlacement", "DeviceUnavailableError", "count_gpus", "place_devices"]
