"""The tooling around the kernels: the command line (`cli`), `gdngen build` (`build`),
`gdngen bench` (`bench`), the timers the tuner and the benchmarks share (`timing`) and
`gdngen report`'s plots (`report`). Nothing below `gdngen.dispatch` imports from here."""
