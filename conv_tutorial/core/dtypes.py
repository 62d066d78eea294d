"""The Gluon dtype of each torch dtype the kernels take."""
import torch
from triton.experimental.gluon import language as gl

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
             torch.float8_e4m3fn: gl.float8e4nv}
