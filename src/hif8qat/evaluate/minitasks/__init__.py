"""The offline mini evaluation tasks: their lm-eval YAMLs, the fact tables they are generated from (``generate``)
and the loader lm-eval calls for their data files (``loader``)."""
