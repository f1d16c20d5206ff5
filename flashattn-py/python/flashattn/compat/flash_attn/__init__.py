"""flashattn standing in for flash-attn's top-level module (see ``flashattn.compat``)."""

from flashattn.interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.8.3+flashattn"
__flashattn_compat__ = True
