"""``deepspeed.compression``: the module-path helpers scripts import (``compression.helper``)."""
