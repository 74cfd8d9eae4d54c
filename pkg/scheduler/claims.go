package scheduler

import (
	"context"
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// One ledger for both front doors. kube-scheduler's DRA allocator books
// claims of gpufrac's driver on the node's published devices; this plugin
// books annotation shares on its ledger. Each sees the other so that a
// GPU is never over-committed:
//
//   - the ledger holds every claim share the DRA manager knows, pending
//     allocations of this very scheduler included (SyncClaims, each cycle),
//     as tenants of the GPU's group, so annotation pods fit around them;
//   - the allocator sees annotation shares through the node's slices (the
//     node agent publishes what they leave), and, as those may be stale,
//     Reserve refuses a claim pod whose allocation does not fit the ledger
//     (the DRA plugin's Reserve runs first: our plugin is enabled after
//     the default ones), so it is tried again once the slices are current.

// claimPrint is what decides whether a claim's shares changed: the
// object's version and its allocation's results. A pending allocation
// is not in the object's version, so the results are part of it.
func claimPrint(c *resourceapi.ResourceClaim) string {
	var b strings.Builder
	b.WriteString(c.ResourceVersion)
	if a := c.Status.Allocation; a != nil {
		for _, r := range a.Devices.Results {
			fmt.Fprintf(&b, "|%s/%s/%s/%s/%v", r.Driver, r.Pool, r.Device, r.Request, r.ShareID)
		}
	}
	return b.String()
}

// ours says whether a claim's allocation holds a device of gpufrac's
// driver, without parsing its configs.
func ours(c *resourceapi.ResourceClaim) bool {
	if c.Status.Allocation == nil {
		return false
	}
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == api.DRADriver {
			return true
		}
	}
	return false
}

// SyncClaims makes the ledger's claim tenants exactly the shares the
// claims hold (allocated, or pending in this scheduler). A claim's share
// that does not fit is a conflict, and its node takes no new fraction
// until it is gone; a share that cannot be read is left out (the node
// refuses to prepare it).
func (c *Cache) SyncClaims(claims []*resourceapi.ResourceClaim) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	seen := make(map[types.UID]bool, len(c.claims))
	var errs []error
	for _, claim := range claims {
		if !ours(claim) {
			continue
		}
		seen[claim.UID] = true
		print := claimPrint(claim)
		if old, ok := c.claims[claim.UID]; ok && old.print == print && c.claimGroupsCurrent(old) {
			continue
		}
		c.dropClaim(claim.UID)
		tenants, err := ledgers.ClaimTenants(claim)
		errs = append(errs, err)
		held := claimHeld{print: print, namespace: claim.Namespace, name: claim.Name}
		for _, ct := range tenants {
			ns, ok := c.nodes[ct.Node]
			if !ok || ns.Ledger == nil {
				continue // booked when the node's GPUs are known (the next sync)
			}
			t := ct.Tenant
			t.Groups = []string{ns.GroupOfOrOwn(t.UUIDs[0])}
			c.add(ns, &t)
			klog.Background().V(4).Info("Booked a claim's share", "claim", klog.KObj(claim), "node", ct.Node, "gpu", t.UUIDs[0], "group", t.Groups[0], "conflict", ns.Conflicts[t.Request.Tenant])
			held.shares = append(held.shares, claimShare{node: ct.Node, tenant: &t})
		}
		if len(held.shares) < len(tenants) {
			held.print = "" // some node was unknown: read the claim again next time
		}
		c.claims[claim.UID] = held
	}
	for uid := range c.claims {
		if !seen[uid] {
			c.dropClaim(uid)
		}
	}
	return errors.Join(errs...)
}

// claimHeld is what the ledger holds for one claim.
type claimHeld struct {
	print           string
	namespace, name string
	shares          []claimShare
}

// claimShare is one share of a claim, as a tenant of its node.
type claimShare struct {
	node   string
	tenant *ledgers.Tenant
}

// claimGroupsCurrent says whether a claim's shares sit on the groups that
// hold their GPUs now: a share booked on its GPU's own group before the
// node agent wrote the standing reservation pod's UUID moves onto it.
func (c *Cache) claimGroupsCurrent(h claimHeld) bool {
	for _, s := range h.shares {
		ns := c.nodes[s.node]
		if ns == nil || ns.Tenants[s.tenant.Request.Tenant] != s.tenant || ns.GroupOfOrOwn(s.tenant.UUIDs[0]) != s.tenant.Groups[0] {
			return false // the node was forgotten, or its holder changed
		}
	}
	return true
}

func (c *Cache) dropClaim(uid types.UID) {
	h, ok := c.claims[uid]
	if !ok {
		return
	}
	delete(c.claims, uid)
	for _, s := range h.shares {
		if ns, ok := c.nodes[s.node]; ok && ns.Tenants[s.tenant.Request.Tenant] == s.tenant {
			c.remove(ns, types.UID(s.tenant.Request.Tenant))
		}
	}
}

// ClaimConflict says why a claim's share does not fit its node's ledger,
// or "" when every share of the claim fits. Any conflict on the claim's
// node counts, not only the claim's own: a rebuild books tenants in the
// order of their keys, not of their arrival, so the tenant left out may
// be an annotation pod that the new claim displaced. The node takes no
// new fraction while it has a conflict, from either front door.
func (c *Cache) ClaimConflict(uid types.UID) string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	h := c.claims[uid]
	for _, s := range h.shares {
		ns := c.nodes[s.node]
		if ns == nil {
			continue
		}
		if why, bad := ns.Conflicts[s.tenant.Request.Tenant]; bad {
			return fmt.Sprintf("its share of claim %s/%s does not fit GPU %s beside the node's annotation shares: %s", h.namespace, h.name, s.tenant.UUIDs[0], why)
		}
		for key, why := range ns.Conflicts {
			return fmt.Sprintf("claim %s/%s: node %s has a tenant its ledger cannot place (%s: %s), so it takes no new share", h.namespace, h.name, s.node, key, why)
		}
	}
	return ""
}

// ForgetClaim drops a claim's shares now (a pending allocation this
// plugin refused); the next sync books it again if it still holds them.
func (c *Cache) ForgetClaim(uid types.UID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dropClaim(uid)
}

// syncClaims books the DRA manager's claims, pending allocations included.
func (p *Plugin) syncClaims() error {
	dra := p.handle.SharedDRAManager()
	if dra == nil {
		return nil
	}
	tracker := dra.ResourceClaims()
	claims, err := tracker.List()
	if err != nil {
		return fmt.Errorf("list ResourceClaims: %w", err)
	}
	// List holds what the API (and this scheduler's own writes) say, not
	// the allocations still in flight between Reserve and PreBind.
	for i, c := range claims {
		if pending := tracker.GetPendingAllocation(c.UID); pending != nil {
			c = c.DeepCopy()
			c.Status.Allocation = pending
			claims[i] = c
		}
	}
	klog.Background().V(5).Info("Claims the DRA manager knows", "count", len(claims))
	if err := p.cache.SyncClaims(claims); err != nil {
		klog.Background().V(2).Info("Claim shares the ledger cannot read (the node refuses to prepare them)", "err", err)
	}
	return nil
}

// claimsChargeMiB is the GPU memory the pod's claims of gpufrac's driver
// are charged (api.ClaimsUsage, as the webhook charged them). A claim the
// DRA manager does not hold yet counts nothing: the DynamicResources
// plugin keeps the pod pending until it exists, and the pod is tried again.
func (p *Plugin) claimsChargeMiB(pod *corev1.Pod) (int64, error) {
	dra := p.handle.SharedDRAManager()
	if dra == nil || len(pod.Spec.ResourceClaims) == 0 {
		return 0, nil
	}
	claims := func(pc corev1.PodResourceClaim) (*resourceapi.ResourceClaimSpec, bool, error) {
		name, _, err := resourceclaim.Name(pod, &pc)
		if err != nil || name == nil {
			return nil, false, nil
		}
		claim, err := dra.ResourceClaims().Get(pod.Namespace, *name)
		if err != nil {
			return nil, false, nil
		}
		return &claim.Spec, true, nil
	}
	classLimit := func(class string) (int64, error) {
		c, err := dra.DeviceClasses().Get(class)
		if err != nil {
			return 0, nil // the allocator refuses a claim of a class that does not exist
		}
		return api.ClassLimitMiB(c)
	}
	u, err := api.ClaimsUsage(pod, claims, classLimit)
	if err != nil {
		return 0, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return u.ClaimsMiB, nil
}

// reserveClaims checks, after the DRA plugin's Reserve, that the pod's
// claims of gpufrac's driver fit the ledger beside the annotation shares.
func (p *Plugin) reserveClaims(pod *corev1.Pod) *fwk.Status {
	dra := p.handle.SharedDRAManager()
	if dra == nil || len(pod.Spec.ResourceClaims) == 0 {
		return nil
	}
	if err := p.syncClaims(); err != nil {
		return fwk.AsStatus(err)
	}
	for i := range pod.Spec.ResourceClaims {
		name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[i])
		if err != nil || name == nil {
			continue // the DRA plugin has already refused such a pod
		}
		claim, err := dra.ResourceClaims().Get(pod.Namespace, *name)
		if err != nil {
			continue
		}
		if why := p.cache.ClaimConflict(claim.UID); why != "" {
			// The node's slices did not yet show an annotation share:
			// drop the share now, and let the pod be tried again.
			p.cache.ForgetClaim(claim.UID)
			return fwk.NewStatus(fwk.Unschedulable, fmt.Sprintf("pod %s/%s: %s", pod.Namespace, pod.Name, why))
		}
	}
	return nil
}

// PostBind wakes the pending claim pods of this scheduler once a pod with
// claims is bound. While a claim's allocation is between the API write
// and the end of PreBind, kube-scheduler's DRA allocator counts it twice
// (in the claim as the informer shows it, and as still in flight), so a
// pod tried in that window can be refused for capacity that is free; and
// the DynamicResources plugin does not queue it again on that claim's
// update (an unrelated claim, to it), nor on the bind. Without this such
// a pod waits for the queue's periodic flush, minutes. By PostBind the
// allocation is counted once: a pod that still does not fit is refused
// again, at the cost of one scheduling attempt.
func (p *Plugin) PostBind(ctx context.Context, _ fwk.CycleState, pod *corev1.Pod, _ string) {
	if len(pod.Spec.ResourceClaims) == 0 || p.handle.SharedDRAManager() == nil {
		return
	}
	all, err := p.handle.SharedInformerFactory().Core().V1().Pods().Lister().List(labels.Everything())
	if err != nil {
		return
	}
	waiting := map[string]*corev1.Pod{}
	for _, q := range all {
		if q.Spec.NodeName == "" && len(q.Spec.ResourceClaims) > 0 && q.Spec.SchedulerName == pod.Spec.SchedulerName && q.UID != pod.UID && !api.PodEnded(q) {
			waiting[q.Namespace+"/"+q.Name] = q
		}
	}
	if len(waiting) > 0 {
		klog.FromContext(ctx).V(4).Info("A claim pod was bound: trying the pending claim pods again", "pod", klog.KObj(pod), "pending", len(waiting))
		p.handle.Activate(klog.FromContext(ctx), waiting)
	}
}
