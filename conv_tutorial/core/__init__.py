"""The facts the package's kernels and the lessons share, free of side effects: the device table,
a conv's geometry and its checks, the fused epilogue's facts, TMA im2col's settings, output windows
and filters read in place (host side), and the fp32 reference conv. Importing it changes nothing."""
from .device import *  # noqa: F401,F403
from .dtypes import *  # noqa: F401,F403
from .epilogue import *  # noqa: F401,F403
from .geometry import *  # noqa: F401,F403
from .reference import *  # noqa: F401,F403
from .tma import *  # noqa: F401,F403
from .windows import *  # noqa: F401,F403
