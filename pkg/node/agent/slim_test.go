package agent

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// fatPod is a tenant's pod as large as the API lets annotations be
// (256KiB in all) with a few containers of many environment variables.
func fatPod(i int) *corev1.Pod {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("fat-%d", i), Namespace: "team", UID: "uid",
			Annotations: map[string]string{
				"team.example.com/blob":                     "x" + strings.Repeat("y", 250<<10),
				"gpu-fraction":                              "0.5",
				api.ContainerKey("main", api.SuffixDevices): "GPU-a",
				api.ResizedFromAnnotation:                   "1Gi/1Gi",
			}},
		Spec: corev1.PodSpec{NodeName: "n", TerminationGracePeriodSeconds: ptr.To[int64](30), HostUsers: ptr.To(false)},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
			{Type: api.ConditionResizePending, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
	for c := range 4 {
		ctr := corev1.Container{Name: fmt.Sprintf("c%d", c), Image: "cuda", SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: ptr.To(false), RunAsUser: ptr.To[int64](1000)}}
		for e := range 500 {
			ctr.Env = append(ctr.Env, corev1.EnvVar{Name: fmt.Sprintf("VAR_%d", e), Value: strings.Repeat("v", 64)})
		}
		pod.Spec.Containers = append(pod.Spec.Containers, ctr)
	}
	return pod
}

// Issue 53: the agent caches of its node's pods only what it reads.
func TestSlimPodKeepsWhatTheAgentReads(t *testing.T) {
	fat := fatPod(0)
	priority := int32(1000)
	fat.Spec.Priority = &priority // burst reclaim's order
	obj, err := slimPod(fat)
	if err != nil {
		t.Fatal(err)
	}
	slim := obj.(*corev1.Pod)
	if slim.Spec.Priority == nil || *slim.Spec.Priority != 1000 {
		t.Error("the pod's priority was dropped")
	}
	if _, ok := slim.Annotations["team.example.com/blob"]; ok {
		t.Error("a tenant's own annotation was kept")
	}
	for _, k := range []string{"gpu-fraction", api.ContainerKey("main", api.SuffixDevices), api.ResizedFromAnnotation} {
		if slim.Annotations[k] == "" {
			t.Errorf("%s was dropped", k)
		}
	}
	if len(slim.Status.Conditions) != 1 || slim.Status.Conditions[0].Type != api.ConditionResizePending {
		t.Errorf("conditions %v, want only the resize's", slim.Status.Conditions)
	}
	if slim.Status.Phase != corev1.PodRunning || *slim.Spec.TerminationGracePeriodSeconds != 30 || *slim.Spec.HostUsers {
		t.Errorf("phase, grace or user namespace lost: %+v %+v", slim.Status, slim.Spec)
	}
	if len(slim.Spec.Containers) != 4 || slim.Spec.Containers[1].Env != nil || *slim.Spec.Containers[1].SecurityContext.AllowPrivilegeEscalation {
		t.Errorf("containers %+v, want names and escalation only", slim.Spec.Containers)
	}
}

// BenchmarkPodCache is what the agent's informer holds per cached pod,
// whole and slimmed (bytes/pod), for the fat pods above: the figure the
// agent's memory limit must cover, a node's worth of pods times this.
func BenchmarkPodCache(b *testing.B) {
	const pods = 50
	for _, c := range []struct {
		name      string
		transform func(any) (any, error)
	}{{"whole", func(o any) (any, error) { return o, nil }}, {"slim", slimPod}} {
		b.Run(c.name, func(b *testing.B) {
			var perPod float64
			for b.Loop() {
				runtime.GC()
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				kept := make([]any, pods)
				for i := range kept {
					kept[i], _ = c.transform(fatPod(i))
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				perPod = float64(after.HeapAlloc-before.HeapAlloc) / pods
				runtime.KeepAlive(kept)
			}
			b.ReportMetric(perPod, "bytes/pod")
		})
	}
}
