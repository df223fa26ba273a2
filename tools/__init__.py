"""Command-line tools over the library (benchmarks, conversion, data); run as scripts, never imported by it."""
