//! The labels every sample carries, which of them are wanted
//! ([`LabelChoice`]), and where their values come from.
//!
//! Owns the node's name. The `exe` label comes from
//! `stackscope_metadata::exe`, the container labels from
//! `stackscope_metadata`'s container index; the others straight from the
//! sample header.

/// Label names, as shipped.
pub const COMM: &str = "comm";
pub const EXE: &str = "exe";
pub const NODE: &str = "node";
pub const PID: &str = "pid";
pub const CONTAINER_ID: &str = "container_id";
pub const CONTAINER_NAME: &str = "container_name";
pub const POD: &str = "pod";
pub const NAMESPACE: &str = "namespace";
/// What Pyroscope's SDKs and Grafana call an application; see
/// [`service_name`].
pub const SERVICE_NAME: &str = "service_name";

/// A sample's service, as Grafana's service picker lists services beside
/// those of Pyroscope's SDKs: its pod's (the `app.kubernetes.io/name` or
/// `app` label, else its workload's name), else its container's name, else
/// its executable's file name.
pub fn service_name<'a>(
    container: Option<&'a stackscope_metadata::ContainerLabels>,
    exe: &'a str,
) -> &'a str {
    container
        .and_then(|c| [&*c.service, &*c.name].into_iter().find(|s| !s.is_empty()))
        .unwrap_or_else(|| exe.rsplit('/').next().unwrap_or(exe))
}

/// Which labels samples carry besides `node` (always there). A label
/// without a value for a sample (a host process has no pod) is left off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelChoice {
    pub comm: bool,
    pub exe: bool,
    /// Off by default: one series per process is many more series.
    pub pid: bool,
    pub container_id: bool,
    pub container_name: bool,
    pub pod: bool,
    pub namespace: bool,
    pub service_name: bool,
}

impl Default for LabelChoice {
    fn default() -> Self {
        Self {
            comm: true,
            exe: true,
            pid: false,
            container_id: true,
            container_name: true,
            pod: true,
            namespace: true,
            service_name: true,
        }
    }
}

impl LabelChoice {
    /// Every label name that can be chosen.
    pub const NAMES: [&str; 9] = [
        NODE,
        COMM,
        EXE,
        PID,
        CONTAINER_ID,
        CONTAINER_NAME,
        POD,
        NAMESPACE,
        SERVICE_NAME,
    ];

    /// No label but `node`.
    pub fn none() -> Self {
        Self {
            comm: false,
            exe: false,
            pid: false,
            container_id: false,
            container_name: false,
            pod: false,
            namespace: false,
            service_name: false,
        }
    }

    /// Whether any label needs the process's container.
    pub fn any_container(&self) -> bool {
        self.container_id || self.container_name || self.pod || self.namespace || self.service_name
    }
}

impl std::str::FromStr for LabelChoice {
    type Err = String;

    /// A comma-separated list of label names, e.g. `comm,exe,container_id`.
    fn from_str(list: &str) -> Result<Self, String> {
        let mut choice = Self::none();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let flag = match name {
                NODE => continue,
                COMM => &mut choice.comm,
                EXE => &mut choice.exe,
                PID => &mut choice.pid,
                CONTAINER_ID => &mut choice.container_id,
                CONTAINER_NAME => &mut choice.container_name,
                POD => &mut choice.pod,
                NAMESPACE => &mut choice.namespace,
                SERVICE_NAME => &mut choice.service_name,
                other => {
                    return Err(format!(
                        "unknown label {other:?}; choose from {}",
                        Self::NAMES.join(", ")
                    ));
                }
            };
            *flag = true;
        }
        Ok(choice)
    }
}

/// This machine's host name (as `uname -n` prints it), or `"unknown"`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_choices_parse_and_unknown_names_are_refused() {
        let choice: LabelChoice = "node, comm,container_id,pid".parse().expect("a valid list");
        assert_eq!(
            choice,
            LabelChoice {
                comm: true,
                pid: true,
                container_id: true,
                ..LabelChoice::none()
            }
        );
        assert!(choice.any_container());
        assert!(!"comm,exe".parse::<LabelChoice>().unwrap().any_container());
        let err = "comm,container".parse::<LabelChoice>().unwrap_err();
        assert!(
            err.contains("\"container\"") && err.contains("container_name"),
            "{err}"
        );
    }

    #[test]
    fn a_samples_service_is_its_pods_else_its_containers_else_its_executables() {
        let container = |service: &str, name: &str| stackscope_metadata::ContainerLabels {
            id: "c0ffee".into(),
            name: name.into(),
            pod: "".into(),
            namespace: "".into(),
            service: service.into(),
        };
        assert_eq!(
            service_name(Some(&container("web", "nginx")), "/usr/sbin/nginx"),
            "web"
        );
        assert_eq!(
            service_name(Some(&container("", "nginx")), "/usr/sbin/nginx"),
            "nginx"
        );
        assert_eq!(
            service_name(Some(&container("", "")), "/usr/sbin/nginx"),
            "nginx"
        );
        assert_eq!(service_name(None, "/usr/bin/python3.11"), "python3.11");
        assert_eq!(service_name(None, "[kthread]"), "[kthread]");
    }
}
