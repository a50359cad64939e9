//! Function names as people read them: one set of demangling rules for the
//! agent (which names frames on the node), the collector and the tests, so
//! a frame reads the same wherever it was named.
//!
//! Owns the rules, not where names come from.

/// A readable name for a symbol: Rust (legacy or v0, without the hash),
/// else C++ (without parameters or return type, as flame graphs show it),
/// else as it is (C). Only names with a mangling prefix are tried: a C++
/// demangler also reads bare type codes, and would turn the C function `c`
/// into `char`.
pub fn demangle(name: &str) -> String {
    if !(name.starts_with("_Z") || name.starts_with("_R")) {
        return name.to_owned();
    }
    if let Ok(rust) = rustc_demangle::try_demangle(name) {
        return format!("{rust:#}");
    }
    let options = cpp_demangle::DemangleOptions::new()
        .no_params()
        .no_return_type();
    cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|symbol| symbol.demangle_with_options(&options).ok())
        .unwrap_or_else(|| name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::demangle;

    #[test]
    fn demangles_cpp_without_parameters_and_rust_without_hash() {
        assert_eq!(demangle("c"), "c");
        assert_eq!(demangle("main"), "main");
        assert_eq!(demangle("_ZN6WorkerIiE3runEv"), "Worker<int>::run");
        assert_eq!(
            demangle("_Z8dispatchI6WorkerIiEEvRT_"),
            "dispatch<Worker<int> >"
        );
        assert_eq!(
            demangle("_ZN10rust_chain1a17h0123456789abcdefE"),
            "rust_chain::a"
        );
        assert_eq!(demangle("_ZNotMangled"), "_ZNotMangled");
    }
}
