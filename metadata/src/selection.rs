//! Turns what the user selects (`--container`, `--cgroup`, `--namespace`,
//! `--pod-label`, `--budget`) into the BPF program's cgroup policies: which
//! cgroup v2 ids are selected, and which sample 1 tick in N.
//!
//! Containers and pods come and go, so the policies are made again on a
//! period from the cgroup2 hierarchy (a cgroup named after a container id
//! says which container it is) and the kubelet's pod list; the agent
//! writes the difference into the map. One entry per matching cgroup is
//! enough: the program also checks every ancestor of a task's cgroup, so
//! whatever a container starts below its cgroup is covered.

use std::{collections::HashMap, collections::HashSet, path::PathBuf, str::FromStr};

use crate::container;
use agent_common::{CgroupPolicy, policy_flags};

use super::{kubelet::PodList, runtime_names::RuntimeNames};
use crate::cgroups::{self, CgroupError};

/// Cgroups visited per refresh at most: a node runs a few hundred
/// containers, each a handful of cgroups.
const MAX_CGROUPS_WALKED: usize = 100_000;

/// Shortest container id prefix accepted (Docker's short ids are 12).
pub const MIN_ID_PREFIX: usize = 12;

/// One way of naming a set of cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// A cgroup v2 directory, or its path as `/proc/<pid>/cgroup` shows it.
    Cgroup(String),
    /// A container id (or a prefix of at least [`MIN_ID_PREFIX`] hex
    /// digits), or a container name (the runtime's, or the container's name
    /// in its pod).
    Container(String),
    /// Every pod of a Kubernetes namespace.
    Namespace(String),
    /// Every pod carrying this label.
    PodLabel(String, String),
}

impl Selector {
    fn needs_pods(&self) -> bool {
        matches!(self, Selector::Namespace(_) | Selector::PodLabel(..))
    }
}

impl FromStr for Selector {
    type Err = String;

    /// `container=ID|NAME`, `cgroup=PATH`, `namespace=NS` or
    /// `pod-label=KEY=VALUE`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (kind, value) = text.split_once('=').ok_or_else(|| {
            format!("{text:?} is not KIND=VALUE (container=, cgroup=, namespace=, pod-label=)")
        })?;
        if value.is_empty() {
            return Err(format!("{text:?}: empty {kind}"));
        }
        match kind {
            "container" => Ok(Selector::Container(value.to_string())),
            "cgroup" => Ok(Selector::Cgroup(value.to_string())),
            "namespace" => Ok(Selector::Namespace(value.to_string())),
            "pod-label" => parse_pod_label(value).map(|(k, v)| Selector::PodLabel(k, v)),
            other => Err(format!(
                "unknown selector kind {other:?}: use container=, cgroup=, namespace= or pod-label="
            )),
        }
    }
}

/// `KEY=VALUE`, as `--pod-label` takes it.
pub fn parse_pod_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("pod label {text:?} is not KEY=VALUE")),
    }
}

/// A 1-in-`divisor` sampling budget for the tasks of `selector`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub selector: Selector,
    pub divisor: u32,
}

impl FromStr for Budget {
    type Err = String;

    /// `SELECTOR:N`, e.g. `container=api:4` or `namespace=batch:10`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (selector, divisor) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("budget {text:?} is not SELECTOR:N (e.g. container=api:4)"))?;
        let divisor: u32 = divisor
            .parse()
            .ok()
            .filter(|n| (2..=1_000_000).contains(n))
            .ok_or_else(|| format!("budget {text:?}: N must be a whole number in 2..=1000000"))?;
        Ok(Budget {
            selector: selector.parse()?,
            divisor,
        })
    }
}

/// What to sample, before it is resolved to cgroups.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SelectionConfig {
    pub cgroups: Vec<String>,
    pub containers: Vec<String>,
    pub namespaces: Vec<String>,
    pub pod_labels: Vec<(String, String)>,
    pub budgets: Vec<Budget>,
}

impl SelectionConfig {
    /// Whether only selected cgroups are sampled.
    pub fn filters(&self) -> bool {
        !self.cgroups.is_empty()
            || !self.containers.is_empty()
            || !self.namespaces.is_empty()
            || !self.pod_labels.is_empty()
    }

    /// Whether anything needs the kubelet's pod list.
    pub fn needs_pods(&self) -> bool {
        !self.namespaces.is_empty()
            || !self.pod_labels.is_empty()
            || self.budgets.iter().any(|b| b.selector.needs_pods())
    }

    /// Whether the policies can change while running (anything but fixed
    /// cgroup paths), and so must be made again on a period.
    pub fn changes(&self) -> bool {
        !self.containers.is_empty()
            || !self.namespaces.is_empty()
            || !self.pod_labels.is_empty()
            || self
                .budgets
                .iter()
                .any(|b| !matches!(b.selector, Selector::Cgroup(_)))
    }

    /// The filter as selectors: the pod selection is one (namespaces OR'ed,
    /// labels AND'ed), not one per flag.
    fn filter_matches(&self, cgroup: &mut CgroupFacts<'_>, pods: &PodMatch) -> bool {
        self.cgroups.iter().any(|path| cgroup.is_path(path))
            || self.containers.iter().any(|c| cgroup.is_container(c))
            || ((!self.namespaces.is_empty() || !self.pod_labels.is_empty())
                && cgroup
                    .pod_uid()
                    .is_some_and(|uid| pods.filter.contains(uid)))
    }
}

/// Why the selection could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(
        "--namespace, --pod-label and pod budgets need the kubelet's pod list: \
         set --kubelet-url (in Kubernetes it defaults to the node's kubelet)"
    )]
    NoKubelet,
    #[error("{0:?} is not a container id prefix ({MIN_ID_PREFIX}+ hex digits) or a container name")]
    BadContainer(String),
}

/// See the module documentation.
#[derive(Debug)]
pub struct Resolver {
    /// The cgroup2 hierarchy, found only when something is selected or
    /// budgeted: profiling everything works on hosts (and in containers)
    /// that show no cgroup2 mount.
    mount: Option<PathBuf>,
    config: SelectionConfig,
}

impl Resolver {
    /// Checks the selection: `--cgroup` paths must exist now (a typo would
    /// otherwise sample nothing, silently).
    pub fn new(config: SelectionConfig, have_pods: bool) -> Result<Self, SelectionError> {
        if config.needs_pods() && !have_pods {
            return Err(SelectionError::NoKubelet);
        }
        let budget_paths = config.budgets.iter().filter_map(|b| match &b.selector {
            Selector::Cgroup(path) => Some(path),
            _ => None,
        });
        for path in config.cgroups.iter().chain(budget_paths) {
            cgroups::resolve(path)?;
        }
        // Budget selectors refuse empty values when parsed.
        if let Some(empty) = config.containers.iter().find(|c| c.is_empty()) {
            return Err(SelectionError::BadContainer(empty.clone()));
        }
        let mount = if config.filters() || !config.budgets.is_empty() {
            Some(cgroups::cgroup2_mount()?)
        } else {
            None
        };
        Ok(Self { mount, config })
    }

    pub fn config(&self) -> &SelectionConfig {
        &self.config
    }

    /// The policies for the cgroups as they are now.
    pub fn policies(
        &self,
        pods: Option<&PodList>,
        names: &mut RuntimeNames,
    ) -> Result<HashMap<u64, CgroupPolicy>, SelectionError> {
        let mut policies: HashMap<u64, CgroupPolicy> = HashMap::new();
        let Some(mount) = &self.mount else {
            return Ok(policies);
        };
        let pod_match = PodMatch::new(&self.config, pods);
        cgroups::walk(mount, MAX_CGROUPS_WALKED, |path, id| {
            let identity = container::identify(path);
            let mut facts = CgroupFacts {
                path,
                mount,
                identity: identity.as_ref(),
                pods,
                names: &mut *names,
            };
            let mut policy = CgroupPolicy::default();
            if self.config.filter_matches(&mut facts, &pod_match) {
                policy.flags |= policy_flags::SELECTED;
            }
            for (index, budget) in self.config.budgets.iter().enumerate() {
                if facts.matches(&budget.selector, &pod_match, index) {
                    policy.divisor = policy.divisor.max(budget.divisor);
                }
            }
            if policy != CgroupPolicy::default() {
                policies.insert(id, policy);
            }
        })?;
        Ok(policies)
    }
}

/// The pods each pod selector picks, by UID.
struct PodMatch {
    /// Pods the filter (`--namespace`, `--pod-label`) selects.
    filter: HashSet<String>,
    /// Pods each budget selects, by budget index (empty for non-pod ones).
    budgets: Vec<HashSet<String>>,
}

impl PodMatch {
    fn new(config: &SelectionConfig, pods: Option<&PodList>) -> Self {
        let uids = |namespaces: &[String], labels: &[(String, String)]| -> HashSet<String> {
            pods.map(|pods| {
                pods.matching(namespaces, labels)
                    .into_iter()
                    .map(|pod| pod.uid.clone())
                    .collect()
            })
            .unwrap_or_default()
        };
        let filter = if config.namespaces.is_empty() && config.pod_labels.is_empty() {
            HashSet::new()
        } else {
            uids(&config.namespaces, &config.pod_labels)
        };
        let budgets = config
            .budgets
            .iter()
            .map(|budget| match &budget.selector {
                Selector::Namespace(ns) => uids(std::slice::from_ref(ns), &[]),
                Selector::PodLabel(k, v) => uids(&[], &[(k.clone(), v.clone())]),
                _ => HashSet::new(),
            })
            .collect();
        Self { filter, budgets }
    }
}

/// What is known of one cgroup of the walk.
struct CgroupFacts<'a> {
    /// Relative to the hierarchy's root, as `/proc/<pid>/cgroup` shows it.
    path: &'a str,
    mount: &'a std::path::Path,
    identity: Option<&'a container::ContainerIdentity>,
    pods: Option<&'a PodList>,
    names: &'a mut RuntimeNames,
}

impl CgroupFacts<'_> {
    fn pod_uid(&self) -> Option<&str> {
        self.identity
            .and_then(|identity| identity.pod_uid.as_deref())
    }

    fn matches(&mut self, selector: &Selector, pods: &PodMatch, budget: usize) -> bool {
        match selector {
            Selector::Cgroup(path) => self.is_path(path),
            Selector::Container(container) => self.is_container(container),
            Selector::Namespace(_) | Selector::PodLabel(..) => self
                .pod_uid()
                .is_some_and(|uid| pods.budgets.get(budget).is_some_and(|s| s.contains(uid))),
        }
    }

    /// `selection` is this cgroup, given under the mount or relative to it.
    fn is_path(&self, selection: &str) -> bool {
        let relative = selection
            .strip_prefix(self.mount.to_str().unwrap_or_default())
            .unwrap_or(selection);
        relative.trim_end_matches('/').trim_start_matches('/') == self.path.trim_start_matches('/')
    }

    /// `wanted` is this container's id, an id prefix, or its name.
    fn is_container(&mut self, wanted: &str) -> bool {
        let Some(identity) = self.identity else {
            return false;
        };
        let id = &identity.container_id;
        if wanted.len() >= MIN_ID_PREFIX && id.starts_with(&wanted.to_ascii_lowercase()) {
            return true;
        }
        if let Some((_, container)) = self.pods.and_then(|pods| pods.by_container_id(id)) {
            return container.name == wanted;
        }
        self.names
            .name(identity.runtime, id)
            .is_some_and(|name| &*name == wanted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_and_budgets_parse_with_clear_errors() {
        assert_eq!(
            "container=api".parse::<Selector>(),
            Ok(Selector::Container("api".into()))
        );
        assert_eq!(
            "pod-label=app=web".parse::<Selector>(),
            Ok(Selector::PodLabel("app".into(), "web".into()))
        );
        assert_eq!(
            "container=api:4".parse::<Budget>(),
            Ok(Budget {
                selector: Selector::Container("api".into()),
                divisor: 4
            })
        );
        assert_eq!(
            "cgroup=/sys/fs/cgroup/a:b:10".parse::<Budget>(),
            Ok(Budget {
                selector: Selector::Cgroup("/sys/fs/cgroup/a:b".into()),
                divisor: 10
            })
        );
        for (bad, needle) in [
            ("container=api", "SELECTOR:N"),
            ("container=api:1", "2..=1000000"),
            ("container=api:x", "whole number"),
            ("pod=api:4", "unknown selector kind"),
            ("container=:4", "empty container"),
            ("pod-label=app:4", "KEY=VALUE"),
        ] {
            let err = bad.parse::<Budget>().unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn pod_selectors_without_a_pod_list_are_refused() {
        let config = SelectionConfig {
            namespaces: vec!["shop".into()],
            ..SelectionConfig::default()
        };
        assert!(matches!(
            Resolver::new(config, false),
            Err(SelectionError::NoKubelet)
        ));
    }

    #[test]
    fn what_filters_needs_pods_and_changes() {
        let none = SelectionConfig::default();
        assert!(!none.filters() && !none.needs_pods() && !none.changes());
        let cgroup = SelectionConfig {
            cgroups: vec!["/a".into()],
            ..SelectionConfig::default()
        };
        assert!(cgroup.filters() && !cgroup.changes());
        let budget = SelectionConfig {
            budgets: vec!["namespace=batch:10".parse().unwrap()],
            ..SelectionConfig::default()
        };
        assert!(!budget.filters() && budget.needs_pods() && budget.changes());
    }
}
