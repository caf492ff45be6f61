"""Benchmark scripts (run them as ``python benchmarks/<script>.py``); a package so that tests can
import ``benchmarks.gpu_check``'s summary builder and ``benchmarks.gpu_probes``' checks."""
