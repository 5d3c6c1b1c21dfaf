from zerotrain.engine.engine import ZeroTrainEngine
from zerotrain.engine.initialize import initialize

__all__ = ["ZeroTrainEngine", "initialize"]
