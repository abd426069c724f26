"""Hopper (sm_90) kernels in Pallas Mosaic GPU: TMA, wgmma and warp specialisation.

`prefill_attention` computes what `jaxflash.prefill_attention` computes; `supports` says
whether it can serve a call (None) or why not (a string), for the dispatch in
`jaxflash.attention`. Importing this package never fails: without Mosaic GPU, `supports`
gives the import error as its reason.

config.py: the tiles, modes and tuned table; pipeline.py: tile scheduler, K/V ring and the
consumers' turns; tiles.py: where a key block's tiles come from (caches or page pools);
softmax.py: the online softmax; mask.py: which keys a row sees; forward.py: the forward
kernel; backward.py: the backward kernels; backward_config.py: their tiles and the dispatch's
check; float16_dq.py: the dQ kernel's float16 operands; segments.py: packed documents.
"""
from jaxflash.mosaic.backward_config import MosaicBackwardConfig
from jaxflash.mosaic.config import MosaicPrefillConfig, mosaic_prefill_config, supports
from jaxflash.mosaic.forward import prefill_attention
from jaxflash.prefill import prefill_reference

__all__ = ["prefill_attention", "prefill_reference", "supports", "MosaicPrefillConfig",
           "mosaic_prefill_config", "MosaicBackwardConfig"]
