"""benchmarks/monokernel_regs.py's reading of an `nvdisasm -g` listing: spill instructions (STL / LDL, any width or
cache suffix) counted under the source line whose `//## File` comment precedes them, nothing else counted."""
from ..scripts import load_script

LISTING = """
        //## File "/x/kernels/monokernel/kernel.py", line 314
        /*0610*/                   STL [R1+0x40], R6 ;
        /*0620*/                   LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0630*/                   STL.64 [R1+0x48], R10 ;
        //## File "/y/triton/language/standard.py", line 191
        /*2740*/              @!P0 STL [R1+0x2c], R15 ;
        /*2750*/                   LDL.LU R60, [R1+0x28] ;
        /*2760*/                   LDS R61, [R3] ;
        //## File "/x/kernels/monokernel/kernel.py", line 314
        /*2770*/                   LDL R62, [R1+0x40] ;
"""


def test_spill_sites_counts_local_memory_instructions_by_source_line():
    tool = load_script("benchmarks/monokernel_regs.py")
    n, sites = tool.spill_sites(LISTING)
    assert n == 5
    assert dict(sites) == {"kernel.py:314": 3, "standard.py:191": 2}
    assert tool.spill_sites(LISTING, top=1)[1] == [("kernel.py:314", 3)]
