"""Host memory on huge pages (kvserve.huge_pages): aligned, asked of the OS, and ordinary memory elsewhere."""

from pathlib import Path

import pytest
import torch

from kvserve import huge_pages

THP = huge_pages._madvise() is not None


def madvised_huge(address: int) -> bool:
    """Whether the mapping holding `address` is marked MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here")
def test_a_buffer_starts_on_a_huge_page_the_os_was_asked_for():
    buffer = huge_pages.huge_page_buffer(3 * huge_pages.HUGE_PAGE + 100)
    assert buffer.dtype is torch.uint8 and buffer.numel() == 3 * huge_pages.HUGE_PAGE + 100
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE == 0 and madvised_huge(buffer.data_ptr())
    buffer.fill_(7)  # usable memory
    assert int(buffer[-1]) == 7


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here")
def test_empty_puts_large_cpu_tensors_on_huge_pages():
    small = huge_pages.empty((64, 4, 16, 128), torch.float16, torch.device("cpu"))  # 1 MiB: less than a page
    large = huge_pages.empty((256, 4, 16, 128), torch.float16, torch.device("cpu"))  # 4 MiB
    assert small.shape == (64, 4, 16, 128) and large.shape == (256, 4, 16, 128)
    assert large.dtype is torch.float16 and large.is_contiguous() and madvised_huge(large.data_ptr())
    assert small.untyped_storage().nbytes() == small.nbytes  # its own allocation, not a buffer's view
    meta = huge_pages.empty((256, 4, 16, 128), torch.float16, torch.device("meta"))
    assert meta.device.type == "meta"


def test_where_the_os_gives_none_memory_is_ordinary(monkeypatch):
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)
    assert huge_pages.huge_page_buffer(4 * huge_pages.HUGE_PAGE) is None
    tensor = huge_pages.empty((1024, 1024), torch.float32, torch.device("cpu"))
    assert tensor.shape == (1024, 1024) and tensor.dtype is torch.float32
