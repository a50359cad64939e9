//! Empty on purpose: the programs live in `main.rs` and are built for the BPF
//! target by `agent/build.rs`. This library target only gives the agent a
//! build-dependency, so cargo rebuilds the agent when the BPF sources change.
#![no_std]
