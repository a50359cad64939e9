//! Where a container's names come from, behind one small trait: the
//! kubelet's pod list ([`PodList`]: container, pod and namespace names,
//! the only names containerd's and CRI-O's containers have) and the
//! runtimes' own state on disk ([`RuntimeNames`]: Podman's and Docker's
//! container names, outside Kubernetes). [`crate::ContainerIndex`] asks
//! them in order and takes the first answer, so a new source (another
//! runtime's API, a process's environment) is one more implementation, not
//! another branch in the index.
//!
//! Owns the trait and what a source answers. Does not own reading the
//! sources (the kubelet client, the runtimes' files) nor when their answers
//! are looked up again (the index).

use std::sync::Arc;

use crate::{container::ContainerIdentity, kubelet::PodList, runtime_names::RuntimeNames};

/// What a source knows of a container's names. Empty strings for what it
/// does not say (a runtime knows no pod).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerNames {
    pub name: Arc<str>,
    pub pod: Arc<str>,
    pub namespace: Arc<str>,
    /// The service the pod is part of ([`PodInfo::service_name`]).
    ///
    /// [`PodInfo::service_name`]: crate::kubelet::PodInfo::service_name
    pub service: Arc<str>,
}

/// A source of container names.
pub trait NameProvider {
    /// The names of the container `identity` says, or `None` when this
    /// source does not know the container (yet).
    fn names(&mut self, identity: &ContainerIdentity) -> Option<ContainerNames>;
}

/// The kubelet's pod list, by the container's runtime id.
impl NameProvider for Arc<PodList> {
    fn names(&mut self, identity: &ContainerIdentity) -> Option<ContainerNames> {
        let (pod, container) = self.by_container_id(&identity.container_id)?;
        Some(ContainerNames {
            name: container.name.as_str().into(),
            pod: pod.name.as_str().into(),
            namespace: pod.namespace.as_str().into(),
            service: pod.service_name().unwrap_or("").into(),
        })
    }
}

/// The runtime's state on disk: a name only.
impl NameProvider for RuntimeNames {
    fn names(&mut self, identity: &ContainerIdentity) -> Option<ContainerNames> {
        let name = self.name(identity.runtime, &identity.container_id)?;
        Some(ContainerNames {
            name,
            ..ContainerNames::default()
        })
    }
}
