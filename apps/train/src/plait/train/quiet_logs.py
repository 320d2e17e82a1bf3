"""Imported for its effect: drops one torch log line that importing torchao prints in every run.

torchao 0.18 registers its Enum config types with ``torch.utils._pytree.register_constant``, which
torch 2.15 logs as deprecated (two ``W... is an Enum subclass and is now natively supported by
torch.compile`` lines). transformers imports torchao whenever it is installed, so the fork server's
preload and every HF recipe printed them, in runs that never use float8. The notice is about
torchao's code, not the user's; only records carrying that text are dropped (a filter on that one
logger), and torch's other pytree warnings still print. Drop this module once torchao stops calling
``register_constant`` on Enums.

The rank fork server preloads this module before transformers; the command line imports it first.
"""

import logging

_NOTICE = "is an Enum subclass and is now natively supported by torch.compile"


class _DropEnumConstantNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _NOTICE not in record.getMessage()


_logger = logging.getLogger("torch.utils._pytree")
if not any(isinstance(f, _DropEnumConstantNotice) for f in _logger.filters):
    _logger.addFilter(_DropEnumConstantNotice())
