package scheduler

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// mover is a pod that opted in to being moved, made by a ReplicaSet.
func mover(prio int32) *corev1.Pod {
	yes := true
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "m", Namespace: "ns", Labels: map[string]string{api.LabelPreemptibility: api.Preemptible},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs", UID: "rs", Controller: &yes}}},
		Spec: corev1.PodSpec{Priority: &prio, Containers: []corev1.Container{{Name: "c", Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2"), corev1.ResourceMemory: resource.MustParse("1Gi")}}}}},
	}
}

func TestOnlyOptedInPodsWithAControllerMove(t *testing.T) {
	if !movable(mover(0), 0) {
		t.Fatal("an opted-in ReplicaSet pod of equal priority does not move")
	}
	for name, edit := range map[string]func(*corev1.Pod){
		"not labelled":      func(p *corev1.Pod) { p.Labels = nil },
		"non-preemptible":   func(p *corev1.Pod) { p.Labels[api.LabelPreemptibility] = "non-preemptible" },
		"a bare pod":        func(p *corev1.Pod) { p.OwnerReferences = nil },
		"a DaemonSet's":     func(p *corev1.Pod) { p.OwnerReferences[0].Kind = "DaemonSet" },
		"a static mirror":   func(p *corev1.Pod) { p.OwnerReferences[0].Kind = "Node" },
		"higher priority":   func(p *corev1.Pod) { *p.Spec.Priority = 1 },
		"already deleting":  func(p *corev1.Pod) { p.DeletionTimestamp = &metav1.Time{Time: time.Now()} },
		"owned, no control": func(p *corev1.Pod) { p.OwnerReferences[0].Controller = nil },
		"a Job's":           func(p *corev1.Pod) { p.OwnerReferences[0].Kind = "Job" },
		"a volume claim": func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{{Name: "d", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "d"}}}}
		},
		"a host port": func(p *corev1.Pod) {
			p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 80, HostPort: 80}}
		},
		"anti-affinity": func(p *corev1.Pod) { p.Spec.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{}} },
		"spread": func(p *corev1.Pod) {
			p.Spec.TopologySpreadConstraints = []corev1.TopologySpreadConstraint{{MaxSkew: 1}}
		},
		"a DRA claim": func(p *corev1.Pod) { p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu"}} },
	} {
		p := mover(0)
		edit(p)
		if movable(p, 0) {
			t.Errorf("%s: moves", name)
		}
	}
}

func TestAMovedPodGoesOnlyWhereItsSpecRuns(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: map[string]string{"pool": "a"}},
		Status: corev1.NodeStatus{Allocatable: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("5"), corev1.ResourceMemory: resource.MustParse("8Gi")}}}
	info := framework.NewNodeInfo()
	info.SetNode(node)
	p := mover(0)
	if !mayRunOn(p, info, nil) {
		t.Fatal("a pod that fits the node may not run there")
	}
	if other := mover(0); mayRunOn(p, info, []*corev1.Pod{other, mover(0)}) {
		t.Error("three pods of 2 CPUs fit 5 CPUs")
	}
	here := mover(0)
	here.Spec.NodeName = "n"
	if !mayRunOn(here, info, []*corev1.Pod{mover(0)}) {
		t.Error("a pod moved within its node is counted twice")
	}
	sel := mover(0)
	sel.Spec.NodeSelector = map[string]string{"pool": "b"}
	if mayRunOn(sel, info, nil) {
		t.Error("a pod lands outside its node selector")
	}
	node.Spec.Taints = []corev1.Taint{{Key: "gpu", Value: "x", Effect: corev1.TaintEffectNoSchedule}}
	info.SetNode(node)
	if mayRunOn(p, info, nil) {
		t.Error("a pod lands on a taint it does not tolerate")
	}
	p.Spec.Tolerations = []corev1.Toleration{{Key: "gpu", Operator: corev1.TolerationOpExists}}
	if !mayRunOn(p, info, nil) {
		t.Error("a pod that tolerates the taint may not run there")
	}
}
