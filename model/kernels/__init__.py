"""Hot operations behind one dispatch seam: each op has a torch reference here; Triton kernels
register as another backend."""
