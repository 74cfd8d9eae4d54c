package api

import (
	"encoding/json"
	"fmt"
	"maps"
	"regexp"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A running share's resize (SPEC §7), in the shape of Kubernetes' in-place
// pod resize (KEP-1287): what the user wants is desired, what the
// scheduler granted is allocated, what the node holds the container to is
// enforced, and each has one writer.
//
//   - desired: KeyResizeRequest and KeyResizeLimit, written by the pod's
//     user on a scheduled pod (the webhook checks them);
//   - allocated: the decision's own .gpu-memory.request and .limit
//     (Assignment), rewritten by gpufrac's scheduler when the resize fits
//     the pod's GPUs, with ResizedFromAnnotation;
//   - enforced: EnforcedAnnotation, written by the node agent once the
//     running container's limits are changed, through pods/status (which
//     no tenant role may write).
//
// The ledger charges the larger of allocated and enforced, so memory a
// shrink frees is offered to others only once the node holds the
// container to less.
const (
	// KeyResizeRequest is the guaranteed memory the pod's fractional
	// container should have on each of its GPUs from now on: a quantity.
	KeyResizeRequest = "gpufrac.io/resize.gpu-memory.request"
	// KeyResizeLimit is the hard limit it should have: a quantity, at least
	// the request.
	KeyResizeLimit = "gpufrac.io/resize.gpu-memory.limit"
	// ResizedFromAnnotation is written by gpufrac's scheduler with a
	// resize's new allocation: what the node enforced when the allocation
	// last changed, which it goes on enforcing until it says otherwise
	// (EnforcedAnnotation).
	ResizedFromAnnotation = "gpufrac.io/resized-from"
	// EnforcedAnnotation is written by the node agent: the memory it holds
	// the running container to since a resize.
	EnforcedAnnotation = "gpufrac.io/enforced-gpu-memory"
)

// The pod conditions of a resize, named as KEP-1287's PodResizePending and
// PodResizeInProgress, with their reasons.
const (
	// ConditionResizePending is True while the scheduler cannot grant the
	// desired memory: Deferred (the GPU lacks free memory now) or
	// Infeasible (it never will, or the node cannot resize); False with
	// reason Allocated once it did.
	ConditionResizePending = "gpufrac.io/GPUResizePending"
	// ConditionResizeInProgress is True while the node has not yet applied
	// the allocation to the running container (reason Applying, or Error
	// when it refused), False with reason Done once it has.
	ConditionResizeInProgress = "gpufrac.io/GPUResizeInProgress"

	ReasonResizeDeferred   = "Deferred"
	ReasonResizeInfeasible = "Infeasible"
	ReasonResizeAllocated  = "Allocated"
	ReasonResizeApplying   = "Applying"
	ReasonResizeError      = "Error"
	ReasonResizeDone       = "Done"
)

// Memory is a container's memory on each of its GPUs, in MiB.
type Memory struct {
	RequestMiB, LimitMiB int64
}

// String renders m as EnforcedAnnotation and ResizedFromAnnotation hold it.
func (m Memory) String() string {
	return "request=" + strconv.FormatInt(m.RequestMiB, 10) + "Mi,limit=" + strconv.FormatInt(m.LimitMiB, 10) + "Mi"
}

var memoryRecord = regexp.MustCompile(`^request=([0-9]{1,12})Mi,limit=([0-9]{1,12})Mi$`)

// ParseMemory reads Memory.String's form.
func ParseMemory(s string) (Memory, error) {
	m := memoryRecord.FindStringSubmatch(s)
	if m == nil {
		return Memory{}, fmt.Errorf("%q is not request=<MiB>Mi,limit=<MiB>Mi", s)
	}
	req, _ := strconv.ParseInt(m[1], 10, 64)
	limit, _ := strconv.ParseInt(m[2], 10, 64)
	if req <= 0 || limit < req {
		return Memory{}, fmt.Errorf("%q: want 0 < request ≤ limit", s)
	}
	return Memory{RequestMiB: req, LimitMiB: limit}, nil
}

// Resize is where a scheduled fractional pod's memory stands.
type Resize struct {
	Container string
	// Allocated is the decision (the container's .gpu-memory keys).
	Allocated Memory
	// Desired is what the user asked (KeyResizeRequest/Limit resolved
	// against Allocated); Allocated when nothing is asked.
	Desired Memory
	// Asked says whether the pod carries a resize key.
	Asked bool
	// Enforced is what the node holds the running container to:
	// EnforcedAnnotation when the node wrote it, else what it held when
	// the allocation last changed (ResizedFromAnnotation), else Allocated.
	Enforced Memory
	// Confirmed says whether the node wrote EnforcedAnnotation.
	Confirmed bool
}

// Wanted says whether the user asks for memory the scheduler has not
// granted.
func (r Resize) Wanted() bool { return r.Desired != r.Allocated }

// Applying says whether the node has not yet applied the allocation.
func (r Resize) Applying() bool { return r.Enforced != r.Allocated }

// Done says whether a resize was asked and is granted and applied.
func (r Resize) Done() bool { return r.Asked && !r.Wanted() && !r.Applying() }

// Charged is the memory the ledger books for the pod on each GPU: the
// larger of what was granted and what the node enforces.
func (r Resize) Charged() Memory {
	return Memory{RequestMiB: max(r.Allocated.RequestMiB, r.Enforced.RequestMiB), LimitMiB: max(r.Allocated.LimitMiB, r.Enforced.LimitMiB)}
}

// ResizeOf reads a scheduled pod's resize from its annotations, given its
// decision (ParseAssignments' first). A resize key that cannot be read is
// an error naming it; the node's and the scheduler's records that cannot
// be read count as absent (Enforced is then what the decision says was
// enforced before, or the allocation).
func ResizeOf(annotations map[string]string, a Assignment) (Resize, error) {
	r := Resize{Container: a.Container, Allocated: Memory{RequestMiB: a.RequestMiB, LimitMiB: a.LimitMiB}}
	r.Desired, r.Enforced = r.Allocated, r.Allocated
	if from, err := ParseMemory(annotations[ResizedFromAnnotation]); err == nil {
		r.Enforced = from
	}
	if enforced, err := ParseMemory(annotations[EnforcedAnnotation]); err == nil {
		r.Enforced, r.Confirmed = enforced, true
	}
	desired, asked, err := DesiredMemory(annotations, r.Allocated)
	r.Desired, r.Asked = desired, asked
	if err != nil {
		r.Desired = r.Allocated
	}
	return r, err
}

// DesiredMemory resolves the resize keys against the memory allocated now:
// a request alone keeps the limit, raised to the request if below it; a
// limit alone keeps the request, lowered to the limit if above it. asked
// is false when neither key is set.
func DesiredMemory(annotations map[string]string, allocated Memory) (m Memory, asked bool, err error) {
	p := parser{}
	values := map[string]string{}
	for _, k := range []string{KeyResizeRequest, KeyResizeLimit} {
		if v, ok := annotations[k]; ok {
			values[k] = strings.TrimSpace(v)
		}
	}
	req, hasReq := p.quantityMiB("", KeyResizeRequest, values, KeyResizeRequest, true)
	limit, hasLimit := p.quantityMiB("", KeyResizeLimit, values, KeyResizeLimit, true)
	if len(p.errs) > 0 {
		return allocated, true, p.errs
	}
	m = allocated
	switch {
	case hasReq && hasLimit:
		if limit < req {
			return allocated, true, ErrorList{{Key: KeyResizeLimit, Value: values[KeyResizeLimit],
				Rule: fmt.Sprintf("must be at least %s (%s)", KeyResizeRequest, values[KeyResizeRequest])}}
		}
		m = Memory{RequestMiB: req, LimitMiB: limit}
	case hasReq:
		m = Memory{RequestMiB: req, LimitMiB: max(allocated.LimitMiB, req)}
	case hasLimit:
		m = Memory{RequestMiB: min(allocated.RequestMiB, limit), LimitMiB: limit}
	}
	return m, hasReq || hasLimit, nil
}

// IsResizeKey reports whether key is one a user writes to resize a pod.
func IsResizeKey(key string) bool { return key == KeyResizeRequest || key == KeyResizeLimit }

// IsEnforcedKey says whether key is the node agent's record of the
// memory it holds a resized container to (EnforcedAnnotation), the one
// resize record only node agents write.
func IsEnforcedKey(key string) bool { return key == EnforcedAnnotation }

// IsResizeRecordKey reports whether key is the scheduler's or the node's
// record of a resize, which no user may write.
func IsResizeRecordKey(key string) bool {
	return key == ResizedFromAnnotation || key == EnforcedAnnotation
}

// ResizeDecision is what gpufrac's scheduler writes when it grants a
// resize: the decision with the new memory, and what the node enforces
// now, which it goes on enforcing until it writes EnforcedAnnotation (a
// record of its own of an older allocation outranks it, and says the same).
func ResizeDecision(a Assignment, r Resize, to Memory) Write {
	a.RequestMiB, a.LimitMiB = to.RequestMiB, to.LimitMiB
	w := Write{Set: a.Annotations()}
	w.Set[ResizedFromAnnotation] = r.Enforced.String()
	return w
}

// EnforcedWrite is what the node agent writes once the running container
// is held to m.
func EnforcedWrite(m Memory) Write {
	return Write{Set: map[string]string{EnforcedAnnotation: m.String()}}
}

// ResizeCondition is one of a resize's pod conditions.
func ResizeCondition(kind string, status corev1.ConditionStatus, reason, message string) corev1.PodCondition {
	return corev1.PodCondition{Type: corev1.PodConditionType(kind), Status: status, Reason: reason, Message: message}
}

// IsResizeCondition says whether a pod condition is one of a resize's
// (ConditionResizePending, ConditionResizeInProgress).
func IsResizeCondition(t corev1.PodConditionType) bool {
	return t == ConditionResizePending || t == ConditionResizeInProgress
}

// PodResizeCondition is the pod's condition of type kind, if any.
func PodResizeCondition(pod *corev1.Pod, kind string) (corev1.PodCondition, bool) {
	for _, c := range pod.Status.Conditions {
		if string(c.Type) == kind {
			return c, true
		}
	}
	return corev1.PodCondition{}, false
}

// ResizeStatusPatch is the one form in which the scheduler and the node
// agent write a resize: a strategic merge patch of the pod's status
// subresource (which keeps annotation changes) with the annotations w
// changes and the conditions (merged by type; a condition whose status
// does not change keeps its transition time). The UID is a precondition;
// so is resourceVersion, when given: a write decided on an older pod
// then fails with a conflict instead of saying something stale.
func ResizeStatusPatch(pod *corev1.Pod, resourceVersion string, w Write, now metav1.Time, conditions ...corev1.PodCondition) ([]byte, error) {
	for i := range conditions {
		conditions[i].LastTransitionTime = now
		if old, ok := PodResizeCondition(pod, string(conditions[i].Type)); ok && old.Status == conditions[i].Status {
			conditions[i].LastTransitionTime = old.LastTransitionTime
		}
	}
	meta := map[string]any{"uid": pod.UID}
	if resourceVersion != "" {
		meta["resourceVersion"] = resourceVersion
	}
	if len(w.Set) > 0 || len(w.Remove) > 0 {
		meta["annotations"] = w.MergePatch()
	}
	return json.Marshal(map[string]any{"metadata": meta, "status": map[string]any{"conditions": conditions}})
}

// DescribeResize says in a few words where a scheduled pod's resize
// stands, for gpufrac top, the dashboard and the audit: "" when none is
// asked, or it is granted and applied.
func DescribeResize(pod *corev1.Pod, a Assignment) string {
	r, err := ResizeOf(pod.Annotations, a)
	if err != nil {
		return "resize unreadable: " + err.Error()
	}
	to := func(m Memory) string { return FormatMiB(m.RequestMiB) + "/" + FormatMiB(m.LimitMiB) }
	switch {
	case r.Wanted():
		c, ok := PodResizeCondition(pod, ConditionResizePending)
		if !ok || c.Status != corev1.ConditionTrue {
			return "resize to " + to(r.Desired) + " not decided yet"
		}
		return "resize to " + to(r.Desired) + " " + strings.ToLower(c.Reason)
	case r.Applying():
		if c, ok := PodResizeCondition(pod, ConditionResizeInProgress); ok && c.Status == corev1.ConditionTrue && c.Reason == ReasonResizeError {
			return "resize to " + to(r.Allocated) + " refused by the node, which holds it to " + to(r.Enforced)
		}
		return "resize to " + to(r.Allocated) + " being applied (the node holds it to " + to(r.Enforced) + ")"
	}
	return ""
}

// PodEnded says whether a pod has ended (Succeeded or Failed), so that it
// holds no GPU and has nothing left to resize.
func PodEnded(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

// Resized says whether a scheduler has changed the pod's memory since it
// was placed (ResizedFromAnnotation): its sandbox, made before, may name
// older memory than the pod does now.
func Resized(annotations map[string]string) bool {
	_, ok := annotations[ResizedFromAnnotation]
	return ok
}

// WithMemory returns a copy of annotations with container's canonical
// memory keys set to m: a pod's annotations as its sandbox holds them,
// brought up to the allocation a resize made since.
func WithMemory(annotations map[string]string, container string, m Memory) map[string]string {
	out := maps.Clone(annotations)
	if out == nil {
		out = map[string]string{}
	}
	out[ContainerKey(container, SuffixMemoryRequest)] = strconv.FormatInt(m.RequestMiB, 10) + "Mi"
	out[ContainerKey(container, SuffixMemoryLimit)] = strconv.FormatInt(m.LimitMiB, 10) + "Mi"
	return out
}
