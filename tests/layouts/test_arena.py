"""The CPU arena's memory (layouts/arena.py host_bytes): zeroed, and on Linux a mapping asked for
transparent huge pages, which every decode step's weight stream reads faster than 4 KiB pages."""
import sys
from pathlib import Path

import pytest
import torch

from phaseflip.layouts.arena import host_bytes


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_bytes_are_zeroed_and_sized():
    data = host_bytes(3 << 20)
    assert data.dtype == torch.uint8 and data.numel() == 3 << 20
    assert not data.any()
    assert host_bytes(0).numel() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) and smaps are Linux's")
def test_host_bytes_ask_for_huge_pages():
    data = host_bytes(8 << 20)
    assert "hg" in _vm_flags(data.data_ptr()), "the arena's mapping was not marked MADV_HUGEPAGE"
