"""The operator's device code and its plain launchers: the forward kernel (fprop), the backward's
plans on it (dgrad), the wgrad kernel, and their building blocks. Importing it compiles nothing and
imports none of the torch layer (ops, fusion, training, runtime)."""
