//! Empty on purpose: the programs live in `main.rs` and are built for the BPF
//! target by `sampler/build.rs`. This library target only gives the sampler a
//! build-dependency, so cargo rebuilds the sampler when the BPF sources change.
#![no_std]
