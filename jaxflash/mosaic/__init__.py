"""Hopper (sm_90) kernels in Pallas Mosaic GPU: TMA, wgmma and warp specialisation.

`prefill_attention` computes what `jaxflash.prefill_attention` computes; `supports` says
whether it can serve a call (None) or why not (a string), for the dispatch in
`jaxflash.attention`. Importing this package never fails: without Mosaic GPU, `supports`
gives the import error as its reason.
"""
from jaxflash.mosaic.prefill import (MosaicPrefillConfig, mosaic_prefill_config, prefill_attention,
                                     prefill_reference, supports)

__all__ = ["prefill_attention", "prefill_reference", "supports", "MosaicPrefillConfig",
           "mosaic_prefill_config"]
