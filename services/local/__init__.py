"""A cluster on one machine: the launcher behind `qos-serve up`, `make demo` and the benchmarks,
and the autoscaler that adds and removes its workers."""
