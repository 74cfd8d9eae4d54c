package scheduler

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// leaderPoll is how often a replica that does not lead asks the Lease
// again, and how long an answer is kept: a replica that comes to lead
// starts collecting within it, and a busy collector asks the API server
// at most once per period.
const leaderPoll = 2 * time.Second

// leadership is what the leader-election Lease last said about this
// replica.
type leadership struct {
	mu     sync.Mutex
	asked  time.Time
	leads  bool
	logged time.Time // when it last said it does not lead
}

// leads says whether this replica leads the scheduler's leader election
// (Args.LeaderLease), and so may write outside a scheduling cycle: the
// collector's reservation pods, held-share annotations, orphan deletions
// and resizes. kube-scheduler builds plugins in every replica and starts
// its informers in a standby too unless delayCacheUntilActive is set, so
// the plugin asks the Lease itself. kube-scheduler names its identity
// <hostname>_<uuid> and does not tell its plugins; the hostname (a pod's
// name) tells the replicas apart. Without a lease named every replica
// leads; while the Lease cannot be read none does, and it says so in its
// log once a minute.
func (p *Plugin) leads(ctx context.Context, logger klog.Logger) bool {
	if p.args.LeaderLease == "" {
		return true
	}
	p.lead.mu.Lock()
	defer p.lead.mu.Unlock()
	if time.Since(p.lead.asked) < leaderPoll {
		return p.lead.leads
	}
	ns, name, _ := strings.Cut(p.args.LeaderLease, "/")
	lease, err := p.handle.ClientSet().CoordinationV1().Leases(ns).Get(ctx, name, metav1.GetOptions{})
	host, herr := os.Hostname()
	holder := ""
	if err == nil && lease.Spec.HolderIdentity != nil {
		holder = *lease.Spec.HolderIdentity
	}
	p.lead.asked = time.Now()
	p.lead.leads = err == nil && herr == nil && strings.HasPrefix(holder, host+"_")
	if !p.lead.leads && time.Since(p.lead.logged) >= time.Minute {
		p.lead.logged = time.Now()
		if apierrors.IsNotFound(err) {
			// No election has made it: leaderElect is off while leaderLease
			// is set, and no replica will ever collect.
			logger.Error(err, "The collector writes nothing: leaderLease names a Lease no leader election holds; with one replica and leaderElect false, remove leaderLease", "lease", p.args.LeaderLease)
			return false
		}
		logger.Info("The collector waits: this replica does not lead (leaderLease); the leader creates, annotates and deletes reservation pods and decides resizes",
			"lease", p.args.LeaderLease, "holder", holder, "host", host, "err", errors.Join(err, herr))
	}
	return p.lead.leads
}
