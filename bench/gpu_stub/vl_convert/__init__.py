"""A stand-in for vl-convert-python on the lent GPU machine only.

The real package (33 MB) does not fit the device's transfer limit beside
spaCy. Charts are rendered on the CPU in CI; here they become empty files,
so that the notebooks' other cells can run on the GPU."""

__version__ = "1.9.0.post1"
_SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"/>'
_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc33000000"
    "0049454e44ae426082"
)


def __getattr__(name):
    if name.endswith("svg"):
        return lambda *args, **kwargs: _SVG
    if name.endswith("png"):
        return lambda *args, **kwargs: _PNG
    if name.endswith("locale"):
        return lambda *args, **kwargs: {}
    raise AttributeError(name)
