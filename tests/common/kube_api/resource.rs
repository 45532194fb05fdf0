//! The served resource types and how REST paths address them.

/// The CRD group Calico's Kubernetes datastore uses.
pub const CALICO_CRD_GROUP: &str = "crd.projectcalico.org";

/// One served resource type.
#[derive(Clone, Debug)]
pub struct Resource {
    /// "" for the core group.
    pub group: String,
    pub version: String,
    pub plural: String,
    pub kind: String,
    pub namespaced: bool,
    /// A custom resource: no strategic merge patch, no unconditional update, `generation`,
    /// the object stored as sent, list items keep `kind`/`apiVersion`.
    pub custom: bool,
}

impl Resource {
    fn core(plural: &str, kind: &str, namespaced: bool) -> Resource {
        Resource {
            group: String::new(),
            version: "v1".into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
            custom: false,
        }
    }

    pub fn api_version(&self) -> String {
        match self.group.as_str() {
            "" => self.version.clone(),
            g => format!("{g}/{}", self.version),
        }
    }

    /// `pods`, `ipamhandles.crd.projectcalico.org`: how NotFound/Conflict texts name it.
    pub fn qualified(&self) -> String {
        qualify(&self.plural, &self.group)
    }

    /// `Pod`, `IPAMHandle.crd.projectcalico.org`: how Invalid texts name it.
    pub fn qualified_kind(&self) -> String {
        qualify(&self.kind, &self.group)
    }

    /// The etcd key the real server stores the object under (it shows in some messages).
    pub fn etcd_key(&self, ns: &str, name: &str) -> String {
        let mut key = match (self.group.as_str(), self.plural.as_str()) {
            ("", "nodes") => "/registry/minions".to_string(),
            ("", p) => format!("/registry/{p}"),
            (g, p) => format!("/registry/{g}/{p}"),
        };
        if self.namespaced {
            key = format!("{key}/{ns}");
        }
        format!("{key}/{name}")
    }

    /// Core kinds with a `status` subresource (of these three, only pods matter to Calico).
    pub fn has_status(&self) -> bool {
        !self.custom && ["pods", "nodes", "namespaces"].contains(&self.plural.as_str())
    }

    /// Field paths a `fieldSelector` may use.
    pub fn selectable_fields(&self) -> Vec<&'static str> {
        let mut f = vec!["metadata.name", "metadata.namespace"];
        match (self.custom, self.plural.as_str()) {
            (false, "pods") => f.extend([
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ]),
            (false, "nodes") => f.push("spec.unschedulable"),
            (false, "namespaces") => f.push("status.phase"),
            _ => {}
        }
        f
    }
}

pub fn qualify(name: &str, group: &str) -> String {
    match group {
        "" => name.to_string(),
        g => format!("{name}.{g}"),
    }
}

/// Calico's resources in one group/version, all cluster-scoped custom resources.
/// In `projectcalico.org/v3` IPAMConfig is `IPAMConfiguration`/`ipamconfigurations`.
pub fn calico_resources(group_version: &str) -> Vec<Resource> {
    let (group, version) = group_version
        .split_once('/')
        .expect("a group/version such as crd.projectcalico.org/v1");
    let ipam_config = if group == CALICO_CRD_GROUP {
        ("ipamconfigs", "IPAMConfig")
    } else {
        ("ipamconfigurations", "IPAMConfiguration")
    };
    [
        ("ippools", "IPPool"),
        ("ipamblocks", "IPAMBlock"),
        ("blockaffinities", "BlockAffinity"),
        ("ipamhandles", "IPAMHandle"),
        ipam_config,
        ("clusterinformations", "ClusterInformation"),
        ("ipreservations", "IPReservation"),
        ("felixconfigurations", "FelixConfiguration"),
        ("bgpconfigurations", "BGPConfiguration"),
    ]
    .into_iter()
    .map(|(plural, kind)| Resource {
        group: group.into(),
        version: version.into(),
        plural: plural.into(),
        kind: kind.into(),
        namespaced: false,
        custom: true,
    })
    .collect()
}

pub fn core_resources() -> Vec<Resource> {
    vec![
        Resource::core("pods", "Pod", true),
        Resource::core("namespaces", "Namespace", false),
        Resource::core("nodes", "Node", false),
    ]
}

/// What a REST path addresses.
#[derive(Clone, Debug)]
pub struct Target {
    pub res: Resource,
    /// The namespace in the path (None: cluster-scoped, or a list across all namespaces).
    pub ns: Option<String>,
    /// None: the collection.
    pub name: Option<String>,
    /// The `status` subresource.
    pub status: bool,
}

impl Target {
    pub fn ns(&self) -> &str {
        self.ns.as_deref().unwrap_or("")
    }
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
    /// The object's key in the store, ordered like etcd orders the real keys.
    pub fn key(&self) -> String {
        match &self.ns {
            Some(ns) if self.res.namespaced => format!("{ns}/{}", self.name()),
            _ => self.name().to_string(),
        }
    }
}

/// The resource and object a REST path names, if it is served.
pub fn route(resources: &[Resource], path: &str) -> Option<Target> {
    let (group, rest) = if let Some(rest) = path.strip_prefix("/api/") {
        ("", rest)
    } else {
        let rest = path.strip_prefix("/apis/")?;
        rest.split_once('/')?
    };
    let (version, rest) = rest.split_once('/')?;
    let segs: Vec<&str> = rest.split('/').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return None;
    }
    let find = |plural: &str| {
        resources
            .iter()
            .find(|r| r.group == group && r.version == version && r.plural == plural)
    };
    let target = |res: &Resource, ns: Option<&str>, rest: &[&str]| {
        let (name, status) = match rest {
            [] => (None, false),
            [name] => (Some(name.to_string()), false),
            [name, "status"] if res.has_status() => (Some(name.to_string()), true),
            _ => return None,
        };
        let ns = ns.map(str::to_string);
        Some(Target {
            res: res.clone(),
            ns,
            name,
            status,
        })
    };
    // namespaces/<ns>/<plural>/... for namespaced kinds; otherwise <plural>/...
    if let ["namespaces", ns, plural, rest @ ..] = segs.as_slice() {
        if let Some(res) = find(plural).filter(|r| r.namespaced) {
            return target(res, Some(ns), rest);
        }
    }
    let res = find(segs[0])?;
    if res.namespaced && segs.len() > 1 {
        return None;
    }
    target(res, None, &segs[1..])
}
