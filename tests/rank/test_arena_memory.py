"""The CPU arena's host memory: on transparent huge pages where the kernel gives them, whole and zeroed."""
import pytest
import torch

from phaseflip.kernels.cpu import quant
from phaseflip.rank import arena


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def _rss_anon() -> int:
    """The process's anonymous resident bytes: not ledger.rss_bytes (VmRSS), which also counts the code
    pages a first call maps in (~1.4 MB around this allocation, measured)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024


def test_the_arena_sits_on_huge_pages():
    if not arena.thp_available():
        pytest.skip("this kernel gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled)")
    num_bytes = (9 << 20) + 17
    before = _rss_anon()
    t = arena.allocate_arena(num_bytes, "cpu")
    grown = _rss_anon() - before
    assert t.data_ptr() % arena.HUGE_PAGE == 0
    assert _huge_kib(t) == 8 << 10, "the arena's 4 whole 2 MiB spans are not on huge pages"
    # what the memory ledger counts: the asked bytes, not a huge page past them (a few KiB of slack
    # for the interpreter's own allocations)
    assert 0 <= grown - num_bytes < 64 << 10, f"{num_bytes} bytes asked, the process grew {grown}"


@pytest.mark.parametrize("num_bytes", [1, 4095, 3 << 20, (5 << 20) + 17])
def test_host_bytes_are_whole_zeroed_and_writable(num_bytes):
    t = arena.host_bytes(num_bytes)
    assert t.dtype == torch.uint8 and t.numel() == num_bytes and not t.any()
    t.fill_(7)
    assert int(t.sum()) == 7 * num_bytes


def test_the_weight_report_counts_each_storage_and_what_a_token_reads(cpu_kernels, int8_products):
    """An untied embedding is read one row a token; a tied one is read whole by the head; blocks count
    as stored; how the products on blocks take x is the process's setting on the CPU."""
    slots = {"embed_tokens": arena.Slot(0, (100, 8), torch.float32),          # 3200 bytes, 32 a row
             "layers.0.qkv_proj": arena.Slot(3328, (6, 2, 18), torch.uint8),  # Q4_0: 216 bytes
             "lm_head": arena.Slot(3584, (100, 8), torch.float32)}
    image = arena.HostImage(torch.empty(0, dtype=torch.uint8), slots)
    report = arena.weight_report(image)
    assert report["bytes_by_storage"] == {"float32": 6400, "Q4_0": 216}
    assert report["storage"]["layers.0.qkv_proj"] == "Q4_0"
    assert report["bytes_read_per_token"] == 32 + 216 + 3200
    int8_products(False)
    assert arena.weight_report(image)["block_products_x"] == "as it is, never rounded (exact)"
    if quant.has_int8_dot():
        int8_products(True)
        assert arena.weight_report(image)["block_products_x"].startswith("rounded to int8 per block")
    tied = arena.HostImage(image.data, {**slots, "lm_head": slots["embed_tokens"]})
    assert arena.weight_report(tied)["bytes_read_per_token"] == 3200 + 216
    dense = arena.HostImage(image.data, {k: v for k, v in slots.items() if k != "layers.0.qkv_proj"})
    assert arena.weight_report(dense)["block_products_x"] is None
    assert arena.weight_report(image, device="cuda:0")["block_products_x"] == "as it is (Triton decodes the blocks)"
