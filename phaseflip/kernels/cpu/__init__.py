"""The CPU kernels: the C++ sources (one op namespace, `phaseflip`, ops named cpu_*), their build and
loader (library.py), and the Python around them: the product forms (linear.py) and the boot's choice
among them (forms.py), the batched attention path (attention.py), the fused decoder layers (fused_layer.py)."""
