"""performer_hf.cpu_memory: glibc keeps large freed blocks, so reallocating one does not fault its pages in again.

Measured in a fresh interpreter: the setting is process-wide, and the training tests apply it to this one."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")

PROBE = """
import json, resource, torch
from performer_hf import cpu_memory

def faults(times=10):  # minor page faults while allocating, writing and freeing a 64 MiB tensor `times` times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        torch.ones(64 << 18)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults()
first, again = cpu_memory.retain_freed_memory(), cpu_memory.retain_freed_memory()
faults(1)  # the heap grows once
print(json.dumps({"default": default, "accepted": [first, again], "retained": faults()}))
"""


def test_retained_memory_is_reused_without_page_faults():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pages = (64 << 20) // 4096  # 16,384 pages per tensor, above glibc's largest default mmap threshold
    assert result["default"] >= 9 * pages  # glibc's default: each of the 10 new tensors is mapped and faulted in
    assert result["accepted"] == [True, True]
    assert result["retained"] <= 2 * pages  # reused (the heap may still grow by one tensor, alignment)
