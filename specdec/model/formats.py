"""The names `--weights` accepts (specdec/model/cpu/compact.py says what each one is), in a module
without torch so that command lines can offer them without importing it."""

FORMATS = ("fp32", "bf16", "f16", "int8", "q4", "gguf", "int8-a8", "q4-a8", "gguf-a8")
