"""quantkit.kernels.cpu: the C kernels of CPU serving, each a real .c file beside its Python launcher.

build.py compiles a kernel's sources once per machine (cached by source, flags, CPU and torch) and loads them with
ctypes; a machine without a compiler, AVX-512 or AMX gets None from the loader and the torch path.
"""
