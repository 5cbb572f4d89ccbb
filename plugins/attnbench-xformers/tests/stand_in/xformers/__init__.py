"""A stand-in for the parts of xformers that attnbench-xformers calls — for tests on machines without it.

It is NOT xformers: it implements, in plain torch, the documented semantics of
``memory_efficient_attention_forward`` on 5-D ``BMGHK`` inputs with a
``BlockDiagonalCausalWithOffsetPaddedKeysMask``, and checks the layout the backend passes in. It lets
the plugin's plumbing (cache layout, GQA expansion, per-step bias, output reshape) run through the
conformance suite on CPU; the real kernels are tested on CUDA with the real package.
"""

__version__ = "0.0.0+stand-in"
