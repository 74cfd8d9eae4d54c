// Package admission holds gpufrac's admission decisions: validating pods and
// workload templates with the same rules as `gpufrac validate`, rewriting
// pod-level shorthands into the canonical keys, and guarding the keys only
// the scheduler may write. The decisions are pure functions of the request;
// the webhook handlers are thin adapters over them.
package admission

import (
	"errors"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/manifest"
)

// DefaultSchedulerUser is the identity of gpufrac's scheduler as deployed
// by deploy/: its service account.
const DefaultSchedulerUser = "system:serviceaccount:gpufrac-system:gpufrac-scheduler"

// DefaultNodeAgentUser is the identity of gpufrac's node agents as
// deployed by deploy/: their service account.
const DefaultNodeAgentUser = "system:serviceaccount:gpufrac-system:gpufrac-node-agent"

// SelectionLabel marks pods that ask for a GPU fraction, so that
// schedulers, node agents and people can select them (kubectl get pods -l).
const SelectionLabel = "gpufrac.io/fractional"

// Identity says which requesters are the scheduler: only they may write
// the scheduler-owned keys and change a scheduled pod's fraction.
type Identity struct {
	// Users are user names as the API server authenticates them; a service
	// account is system:serviceaccount:<namespace>:<name>.
	Users []string
	// NodeAgents are the node agents' user names: only they may write
	// what a node enforces after a resize (api.EnforcedAnnotation).
	NodeAgents []string
	// Schedulers are the schedulerNames trusted to place fractions
	// (gpufrac's profiles; KAI's where it is the one), each a name or a
	// glob (path.Match: gpufrac-*). A pod that asks for a fraction with
	// another, or with spec.nodeName, is refused: nothing would pick its
	// GPU, and the node would refuse it anyway. Empty: not checked.
	Schedulers []string
	// DefaultScheduler is the schedulerName the mutating webhook gives a
	// fractional pod that chose none (--scheduler-name); "" for none. A
	// workload's template is judged as its pods will be once mutated.
	DefaultScheduler string
	// AllowRootMPSClients is the node agents' --allow-root-mps-clients: a
	// pod holding a share may then be one that can become root
	// (CheckMPSClientPod), as its containers may run as root.
	AllowRootMPSClients bool
}

// IsScheduler reports whether user is one of the scheduler's identities.
func (i Identity) IsScheduler(user string) bool {
	return slices.Contains(i.Users, user)
}

// Operation is the admission operation being reviewed.
type Operation string

// The operations gpufrac reviews.
const (
	Create Operation = "CREATE"
	Update Operation = "UPDATE"
)

// ReviewPod decides whether user may perform op on a pod. old is nil on
// CREATE. The returned error, when not nil, is the one-line reason for the
// denial; the warnings, admitted or not, are for kubectl to print.
func (i Identity) ReviewPod(op Operation, user string, old, pod *corev1.Pod) (warnings []string, err error) {
	scheduler := i.IsScheduler(user)
	if op == Update && old != nil {
		if err := i.guardUpdate(user, scheduler, old, pod); err != nil {
			return nil, err
		}
		if scheduler || !fractionKeysChanged(old.Annotations, pod.Annotations) {
			// Nothing a user asked for changed: a bound pod's resolved
			// annotations need not (and cannot) parse as user intent.
			return nil, nil
		}
	}
	if op == Create && !scheduler {
		if key := firstKey(pod.Annotations, func(k string) bool { return api.IsResizeKey(k) || api.IsResizeRecordKey(k) }); key != "" {
			return nil, api.ErrorList{{Key: key, Value: pod.Annotations[key],
				Rule: "cannot be set when a pod is created: it resizes the GPU share of a pod already running (set the memory request itself at creation)"}}
		}
		if key := firstKey(pod.Annotations, func(k string) bool { return api.IsDecisionKey(k) && !api.IsSchedulerOwned(k) }); key != "" {
			return nil, api.ErrorList{{Key: key, Value: pod.Annotations[key],
				Rule: fmt.Sprintf("is written by the scheduler (%s) with its decision and cannot be set when a pod is created: remove it", strings.Join(i.Users, ", "))}}
		}
	}
	if op == Update && old != nil && !scheduler {
		// A pod's fraction is fixed when it is created, for everyone but
		// the scheduler: its quota charge is sized then (the mutating
		// webhook) and only then are the create-time checks made. A key
		// added, changed or removed later (even one the parser ignores, so
		// that the pod was no fraction at creation) would be placed
		// uncharged and unchecked.
		key := changedFractionKeys(old.Annotations, pod.Annotations)[0]
		return nil, api.ErrorList{{Key: key, Value: describeChange(old.Annotations, pod.Annotations, key),
			Rule: "cannot be added, changed or removed after the pod is created: a pod's GPU fraction is fixed (and charged to its namespace's quota) at creation; delete and recreate the pod with the annotations it needs"}}
	}
	if scheduler {
		// What the scheduler wrote is not user intent.
		pod = api.Intent(pod)
	}
	reqs, warnings, err := api.Check(pod.Annotations, &pod.Spec)
	if err != nil || scheduler || op != Create {
		return warnings, err
	}
	// A share asked by its annotations, or charged for its claims (the
	// mutating webhook ran first); not a pod whose only key is one the
	// parser ignores.
	if charged, _ := api.ChargedMiB(&pod.Spec); !i.AllowRootMPSClients && (len(reqs) > 0 || charged > 0) {
		if err := CheckMPSClientPod(&pod.Spec); err != nil {
			return warnings, err
		}
	}
	if len(reqs) == 0 {
		return warnings, nil
	}
	return warnings, i.placedByTrusted(pod)
}

// ReviewPhase refuses a move of a pod that holds a share to a terminal
// phase (Failed, Succeeded) by anyone but its node's kubelet (group
// system:nodes; NodeRestriction keeps each node to its own pods) and the
// cluster's own controllers (kube-system's service accounts, the
// controller manager's user, system:masters). The scheduler's ledger,
// the audit and ResourceQuota free a terminal pod's share at once, while
// its containers run on until the kubelet stops them: a tenant's
// pods/status write would free GPU memory a running container still holds.
func (i Identity) ReviewPhase(user string, groups []string, old, pod *corev1.Pod) error {
	phase := pod.Status.Phase
	if old == nil || (phase != corev1.PodFailed && phase != corev1.PodSucceeded) || phase == old.Status.Phase {
		return nil
	}
	if slices.Contains(groups, "system:nodes") || slices.Contains(groups, "system:masters") ||
		strings.HasPrefix(user, "system:serviceaccount:kube-system:") || user == "system:kube-controller-manager" {
		return nil
	}
	if !HoldsShare(old) {
		return nil
	}
	return api.ErrorList{{Key: "status.phase", Value: string(phase),
		Rule: fmt.Sprintf("can be set only by the pod's node (its kubelet) or the cluster's controllers, not by %s: the pod holds a GPU share, whose memory (and quota charge) is freed only when its containers have stopped; delete the pod to end it", user)}}
}

// HoldsShare says whether the pod asks for a share (its annotations), has
// one placed (a decision) or was charged for one (its claims of gpufrac's
// driver).
func HoldsShare(pod *corev1.Pod) bool {
	if mib, _ := api.ChargedMiB(&pod.Spec); mib > 0 {
		return true
	}
	return firstKey(pod.Annotations, func(k string) bool { return api.IsFractionKey(k) || api.IsDecisionKey(k) }) != ""
}

// ReviewEphemeral refuses an ephemeral container a share's pod must not
// have (CheckEphemeralContainers).
func (i Identity) ReviewEphemeral(old, pod *corev1.Pod) error {
	if i.AllowRootMPSClients || old == nil || !HoldsShare(old) {
		return nil
	}
	return CheckEphemeralContainers(old, pod)
}

// placedByTrusted refuses a new fractional pod that no trusted scheduler
// would place: one created bound (spec.nodeName), or given to another
// scheduler. Either would reach a node with no GPU chosen for it, where
// it cannot run; left alone it would only look like a tenant.
func (i Identity) placedByTrusted(pod *corev1.Pod) error {
	if len(i.Schedulers) == 0 {
		return nil
	}
	trusted := strings.Join(i.Schedulers, ", ")
	if pod.Spec.NodeName != "" {
		return api.ErrorList{{Key: "spec.nodeName", Value: pod.Spec.NodeName,
			Rule: fmt.Sprintf("cannot be set on a pod that asks for a GPU fraction: only a trusted scheduler (%s) places one, choosing its GPU; pin it with a nodeSelector or node affinity instead", trusted)}}
	}
	name := pod.Spec.SchedulerName
	if name == "" {
		name = corev1.DefaultSchedulerName
	}
	if !slices.ContainsFunc(i.Schedulers, func(pattern string) bool { ok, _ := path.Match(pattern, name); return ok }) {
		return api.ErrorList{{Key: "spec.schedulerName", Value: name,
			Rule: fmt.Sprintf("is not trusted to place GPU fractions: set schedulerName to one that is (%s)", trusted)}}
	}
	return nil
}

// ReviewBinding decides whether user may bind a pod with a Binding that
// carries these annotations, which the API server copies onto the pod as
// it binds it: gpufrac's scheduler writes its decision that way. A Binding
// both places the pod and sets its annotations, so one from anyone else
// may carry no GPU-fraction key and none of the scheduler's bookkeeping.
func (i Identity) ReviewBinding(user string, annotations map[string]string) error {
	if i.IsScheduler(user) {
		return nil
	}
	var errs api.ErrorList
	for _, key := range slices.Sorted(maps.Keys(annotations)) {
		if !api.IsFractionKey(key) && !api.IsDecisionKey(key) && !api.IsResizeRecordKey(key) {
			continue
		}
		c, _, _ := api.SplitContainerKey(key)
		errs = append(errs, &api.FieldError{Container: c, Key: key, Value: annotations[key],
			Rule: fmt.Sprintf("can be written by a Binding only by the scheduler (%s), not by %s", strings.Join(i.Users, ", "), user)})
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

// guardUpdate denies a user other than the scheduler any change to the
// scheduler-owned keys, and any change to the fraction of a pod that is
// already scheduled.
func (i Identity) guardUpdate(user string, scheduler bool, old, pod *corev1.Pod) error {
	if scheduler {
		return nil
	}
	var errs api.ErrorList
	for _, key := range changedKeys(old.Annotations, pod.Annotations) {
		if !api.IsDecisionKey(key) {
			continue
		}
		c, _, _ := api.SplitContainerKey(key)
		errs = append(errs, &api.FieldError{Container: c, Key: key, Value: describeChange(old.Annotations, pod.Annotations, key),
			Rule: fmt.Sprintf("can be set, changed or removed only by the scheduler (%s), not by %s", strings.Join(i.Users, ", "), user)})
	}
	if len(errs) > 0 {
		return errs
	}
	if node := scheduledTo(old); node != "" && fractionKeysChanged(old.Annotations, pod.Annotations) {
		key := changedFractionKeys(old.Annotations, pod.Annotations)[0]
		return api.ErrorList{{Key: key, Value: describeChange(old.Annotations, pod.Annotations, key),
			Rule: fmt.Sprintf("cannot change: the pod is already scheduled to %s, so its GPU-fraction annotations are fixed; resize its memory with %s (and %s), or delete and recreate the pod to ask for another fraction",
				node, api.KeyResizeRequest, api.KeyResizeLimit)}}
	}
	return i.guardResize(user, old, pod)
}

// guardResize admits a change of a scheduled fractional pod's resize keys
// that reads (api.DesiredMemory) against what its decision allocated, and
// refuses every change of the resize records to anyone but their writer:
// the node agents' record of what they enforce. (The scheduler's own
// writes never get here.)
func (i Identity) guardResize(user string, old, pod *corev1.Pod) error {
	changed := changedKeys(old.Annotations, pod.Annotations)
	for _, key := range changed {
		if !api.IsResizeRecordKey(key) || (api.IsEnforcedKey(key) && slices.Contains(i.NodeAgents, user)) {
			continue
		}
		writer := "the scheduler (" + strings.Join(i.Users, ", ") + ")"
		if api.IsEnforcedKey(key) {
			writer = "a node agent (" + strings.Join(i.NodeAgents, ", ") + ")"
		}
		return api.ErrorList{{Key: key, Value: describeChange(old.Annotations, pod.Annotations, key),
			Rule: fmt.Sprintf("can be set, changed or removed only by %s, not by %s", writer, user)}}
	}
	key := firstKey(pod.Annotations, api.IsResizeKey)
	if !slices.ContainsFunc(changed, api.IsResizeKey) || key == "" {
		return nil // no resize asked, or one taken back
	}
	assignments, err := api.ParseAssignments(old.Annotations)
	if !api.HasDecision(old.Annotations) || err != nil || len(assignments) == 0 {
		return api.ErrorList{{Key: key, Value: pod.Annotations[key],
			Rule: "resizes the GPU share of a pod the scheduler has placed, and this pod has no GPU decision yet: set the memory request itself, or wait until it is scheduled"}}
	}
	a := assignments[0]
	_, _, err = api.DesiredMemory(pod.Annotations, api.Memory{RequestMiB: a.RequestMiB, LimitMiB: a.LimitMiB})
	return err
}

// firstKey is the least key of annotations that match says yes to, or "".
func firstKey(annotations map[string]string, match func(string) bool) string {
	for _, k := range slices.Sorted(maps.Keys(annotations)) {
		if match(k) {
			return k
		}
	}
	return ""
}

// scheduledTo names where the pod is placed: its node, or "a GPU" when the
// scheduler has assigned devices but not yet bound it.
func scheduledTo(pod *corev1.Pod) string {
	if pod.Spec.NodeName != "" {
		return "node " + pod.Spec.NodeName
	}
	for k := range pod.Annotations {
		if api.IsSchedulerOwned(k) {
			return "a GPU"
		}
	}
	return ""
}

// describeChange renders a key's change as its new value, or says it was
// removed, for the error message.
func describeChange(old, cur map[string]string, key string) string {
	if v, ok := cur[key]; ok {
		return v
	}
	return "(removed; was " + old[key] + ")"
}

// changedKeys lists, sorted, the keys added, removed or changed between two
// annotation maps.
func changedKeys(old, cur map[string]string) []string {
	var keys []string
	for k, v := range cur {
		if ov, ok := old[k]; !ok || ov != v {
			keys = append(keys, k)
		}
	}
	for k := range old {
		if _, ok := cur[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys
}

func changedFractionKeys(old, cur map[string]string) []string {
	return slices.DeleteFunc(changedKeys(old, cur), func(k string) bool { return !api.IsFractionKey(k) })
}

func fractionKeysChanged(old, cur map[string]string) bool {
	return len(changedFractionKeys(old, cur)) > 0
}

// ReviewWorkload validates the pod template of a workload (Deployment,
// StatefulSet, DaemonSet, ReplicaSet, Job, CronJob) from its JSON, exactly
// as `gpufrac validate` does, with admission's warnings; and refuses a
// fractional template that no trusted scheduler would place (its pods
// would each be refused, and the controller would retry for ever), judged
// as its pods will be once the mutating webhook has given them a
// scheduler.
func (i Identity) ReviewWorkload(kind string, raw []byte) (warnings []string, err error) {
	obj := manifest.FromJSON(kind, raw)
	reqs, warnings, err := manifest.Validate(obj)
	if err != nil || len(reqs) == 0 || obj.Template == nil || kind == "Pod" {
		return warnings, err
	}
	pod := &corev1.Pod{ObjectMeta: obj.Template.ObjectMeta, Spec: obj.Template.Spec}
	if !i.AllowRootMPSClients {
		if err := CheckMPSClientPod(&pod.Spec); err != nil {
			return warnings, prefixTemplate(err)
		}
	}
	if i.DefaultScheduler != "" && (pod.Spec.SchedulerName == "" || pod.Spec.SchedulerName == corev1.DefaultSchedulerName) {
		pod.Spec.SchedulerName = i.DefaultScheduler
	}
	return warnings, prefixTemplate(i.placedByTrusted(pod))
}

// prefixTemplate names the pod template in err's fields.
func prefixTemplate(err error) error {
	var list api.ErrorList
	if errors.As(err, &list) {
		for _, e := range list {
			e.Key = "pod template " + e.Key
		}
	}
	return err
}

// Normalise returns the annotations and labels a valid fractional pod
// should carry after admission: the canonical keys written from the
// shorthands (which stay), as KAI's admission writes them, and the
// selection label. gpu-memory becomes the canonical request (a canonical
// quantity: 2048 → 2Gi), gpu-memory.limit the canonical limit and
// gpu-fraction.limit KAI's portion limit; a share of a GPU is not written
// as memory, since only the scheduler can resolve it on the GPU it picks.
// Keys already set are left as they are (they agree, or the pod is
// invalid). ok is false when the pod asks for no fraction or is invalid
// (the validating webhook explains why).
func Normalise(pod *corev1.Pod) (annotations, labels map[string]string, ok bool) {
	reqs, err := api.Parse(pod)
	if err != nil || len(reqs) == 0 {
		return nil, nil, false
	}
	annotations = maps.Clone(pod.Annotations)
	set := func(key, value string) {
		if _, present := annotations[key]; !present {
			annotations[key] = value
		}
	}
	for _, r := range reqs {
		set(api.ContainerKey(r.Container, api.SuffixComputeMode), string(r.Mode))
		if _, ok := pod.Annotations[api.KeyMemory]; ok {
			set(api.ContainerKey(r.Container, api.SuffixMemoryRequest), api.FormatMiB(r.Memory.MiB))
		}
		if _, ok := pod.Annotations[api.KeyMemoryLimit]; ok {
			set(api.ContainerKey(r.Container, api.SuffixMemoryLimit), pod.Annotations[api.KeyMemoryLimit])
		}
		if v, ok := pod.Annotations[api.KeyFractionLimit]; ok {
			set(api.PortionLimitKey(r.Container), v)
		}
	}
	labels = maps.Clone(pod.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	labels[SelectionLabel] = "true"
	return annotations, labels, true
}
