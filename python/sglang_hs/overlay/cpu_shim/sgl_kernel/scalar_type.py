"""Names SGLang's quantization code reads at module load (tables of GPTQ/AWQ types).

On CPU they only fill those tables; an attribute of a placeholder type does not exist, so
any real use fails loudly instead of computing something.
"""


class ScalarType:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<sgl_kernel CPU shim placeholder scalar type {self.name}>"


class _ScalarTypes:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return ScalarType(name)


scalar_types = _ScalarTypes()
